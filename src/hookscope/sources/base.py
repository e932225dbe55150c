"""What a source is: the one protocol every extraction source follows (packed text, text plus a
generated continuation, images; later audio or a served model), so that the one extraction loop
(`hookscope.extract`) gives every source every promise: validation before the store is touched,
the data fingerprint, `--max-tokens`, Ctrl-C / SIGTERM, resume, torchrun ranks, `--device-map`,
the progress bar.

`source_for(cfg)` picks the first kind in `KINDS` that `claims(cfg)`. A source is made in two
steps: `check_config(cfg)` refuses what cannot work before any model is loaded, and
`open(cfg, loaded, points, run)` checks the source against the loaded model and reads no more of
the data than it must. Then it gives:

- `settings()`: everything that shapes the stored rows (model identity, points, dtype, the data
  and its fingerprint); a store made with other settings is refused, so they must stay the same
  for as long as old stores should resume.
- `batches()`: the batches in a fixed order; batch i is the same on every run (resume skips the
  committed ones by index, torchrun deals them by index).
- per batch, `model_call(batch)` (the model's inputs and the token mask of the rows kept) and
  `rows(batch, acts)` (captured activations -> store rows and their per-row columns, built with
  `hookscope.sources.columns`). A source never runs the model: the extraction's executor does
  (`hookscope.extract`: in memory, block-streamed or generating) and hands it the activations. A
  source whose rows come from a generation rather than one forward pass (`generates = True`)
  gives `generated_rows(batch, generation)` instead of `rows`.
- `prepare(batch, device)`: what depends on the batch alone, done in the data stage's thread
  ahead of the model (the model call, the columns a source's `columns` gives without the
  activations, the inputs pinned for a non-blocking copy to a CUDA device), so the forward waits
  on nothing the host does.
- `item_tokens()`: the tokens one item of a batch runs as (a block-streamed run sizes its chunks
  by it).
- `rows_in(batch)` (the rows a batch gives, for the progress of skipped batches, when known
  without running it) and `estimate(rows, batch)` (the progress bar's total, or None).

A new source is one new file in this folder: copy `images.py` (one forward pass per batch, no
tokenizer) or `text.py`, and add the class to `KINDS` in `__init__.py`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..extract_config import ExtractConfig, Run
from ..loading import Loaded
from ..model_inputs import attention_mask_of

Rows = tuple[dict[str, Tensor], dict[str, Tensor]]  # {point: [rows, ...]}, {column: [rows]}
# a source's batches, numbered, in index order: what an extraction's executor runs
Batches = Iterable[tuple[int, dict[str, Tensor]]]


@dataclass(frozen=True)
class Call:
    """One batch's model call, made ready by `Source.prepare`: the inputs (pinned when bound for a
    CUDA device), the token mask of the rows kept (on the CPU: the capture finds its rows there, so
    the forward never waits for the device), the rows' columns when the batch alone gives them
    (else None: `rows` builds them from the activations), and whether the inputs' attention mask
    is all ones (read on the CPU: the forward then checks nothing on the device,
    `model_inputs.unpadded`)."""

    inputs: dict[str, Tensor]
    keep: Tensor | None
    columns: dict[str, Tensor] | None
    unpadded: bool = False


class Prepared(dict):
    """A batch (the same keys, the same tensors) with its `call` made ready ahead."""

    call: Call


class Source:
    """The protocol (see the module docstring)."""

    needs_tokenizer: ClassVar[bool] = True
    streamable: ClassVar[bool] = True  # rows = rows(batch, one capture of model_call(batch))
    generates: ClassVar[bool] = False  # rows = generated_rows(batch, a generation from model_call(batch))
    # what a run says when preparing this source's batches sets its pace: what the user can do
    bound_by_data: ClassVar[str] = "bound by the data (reading and preparing the inputs)"

    @classmethod
    def claims(cls, cfg: ExtractConfig) -> bool:
        """Whether this kind reads `cfg.data` (the first kind in `KINDS` that claims it does)."""
        raise NotImplementedError

    @classmethod
    def check_config(cls, cfg: ExtractConfig) -> None:
        """Refuse options this source cannot honour, before anything is loaded."""

    @classmethod
    def open(cls, cfg: ExtractConfig, loaded: Loaded, points: list[str], run: Run) -> Source:
        raise NotImplementedError

    def settings(self) -> dict[str, Any]:
        raise NotImplementedError

    def batches(self) -> Iterator[dict[str, Tensor]]:
        raise NotImplementedError

    def model_call(self, batch: dict[str, Tensor]) -> tuple[dict[str, Tensor], Tensor | None]:
        raise NotImplementedError

    def rows(self, batch: dict[str, Tensor], acts: dict[str, Tensor]) -> Rows:
        raise NotImplementedError

    def columns(self, batch: dict[str, Tensor], keep: Tensor | None) -> dict[str, Tensor] | None:
        """The columns of the rows `keep` keeps, when they depend on the batch alone and the rows
        are the captured activations as they are (text); None where `rows` needs the activations."""
        return None

    def prepare(self, batch: dict[str, Tensor], device: str | torch.device = "cpu") -> Prepared:
        """`batch` with its `Call` made ready (see the module docstring); the data stage's thread
        runs it for every batch to do."""
        inputs, keep = self.model_call(batch)
        mask = attention_mask_of(inputs)
        unpadded = mask is not None and bool(mask.all())
        if torch.device(device).type == "cuda":  # page-locked: the copy to the device does not block
            inputs = {k: v.pin_memory() for k, v in inputs.items()}
        prepared = Prepared(batch)
        prepared.call = Call(inputs, keep, self.columns(batch, keep), unpadded)
        return prepared

    def call_of(self, batch: dict[str, Tensor], device: str | torch.device = "cpu") -> Call:
        """The batch's `Call`: the one made ahead, else made now."""
        return batch.call if isinstance(batch, Prepared) else self.prepare(batch, device).call

    def rows_of(self, batch: dict[str, Tensor], call: Call, acts: dict[str, Tensor]) -> Rows:
        """The rows of `acts` captured for `call`: its ready columns, else `rows`."""
        return (acts, call.columns) if call.columns is not None else self.rows(batch, acts)

    def item_tokens(self) -> int:
        """The tokens one item of a batch (a sequence, a picture) runs through the blocks as: what a
        block-streamed chunk's hidden states are sized by."""
        raise NotImplementedError

    def rows_in(self, batch: dict[str, Tensor]) -> int | None:
        return None

    def estimate(self, rows: int, batch: dict[str, Tensor]) -> int | None:
        return None

    def nothing_to_extract(self) -> str:
        """The error when this rank's deal of the source holds no batch at all."""
        raise NotImplementedError
