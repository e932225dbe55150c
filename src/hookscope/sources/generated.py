"""Packed text plus the model's own continuation (`--generate N`): each packed sequence's kept
tokens, then the N tokens greedy decoding adds after it (up to and including EOS). The
generating executor (extract/generating.py) runs `generate` on this source's prompts; this source
turns what it gives (a `Generation`: tokens and activations) into store rows, with the per-row
columns built by `columns.token_columns` as text's are. Greedy decoding is deterministic, so a
resumed extraction regenerates the same rows. Not streamable: every step needs every block."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..errors import HookscopeError
from ..extract_config import ExtractConfig, Run
from ..generate import Generation
from ..loading import Loaded
from ..model_inputs import max_positions
from .base import Rows
from .columns import token_columns
from .text import TextSource


class GeneratedSource(TextSource):
    streamable = False
    generates = True

    @classmethod
    def claims(cls, cfg: ExtractConfig) -> bool:
        return bool(cfg.generate)

    @classmethod
    def open(cls, cfg: ExtractConfig, loaded: Loaded, points: list[str], run: Run) -> TextSource:
        source = super().open(cfg, loaded, points, run)
        longest = max_positions(loaded.model)
        if longest is not None and source.context + cfg.generate > longest:
            raise HookscopeError(
                f"--context {source.context} + --generate {cfg.generate} is longer than the "
                f"model's {longest} positions; lower one of them"
            )
        return source

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "generate": self.cfg.generate}

    def model_call(self, batch: dict[str, Tensor]) -> tuple[dict[str, Tensor], Tensor | None]:
        """The prompt generate continues: the batch with each row's padding moved to its front (a
        decoder continues after the last column), and the kept tokens in the same order."""
        left = _left_aligned(batch, self.keep(batch))
        return {"input_ids": left["input_ids"], "attention_mask": left["attention_mask"]}, left["keep"]

    def columns(self, batch: dict[str, Tensor], keep: Tensor | None) -> None:
        return None  # the continuation's rows come with their own columns (generated_rows)

    def generated_rows(self, batch: Mapping[str, Tensor], generation: Generation) -> Rows:
        """The store rows of a batch the executor generated from (`extract/generating.py`, greedy
        decoding of `new_tokens` after `model_call`'s prompt), and their columns. Rows run sequence by
        sequence: its kept prompt tokens, then its generated tokens up to and including EOS. A
        continuation belongs to the last document of its sequence; its positions go on from that
        document's last token."""
        gen, left = generation, _left_aligned(batch, self.keep(batch))
        total_new = gen.sequences.shape[1] - gen.prompt_length
        rows_mask = torch.cat([left["keep"], gen.mask[:, gen.prompt_length :].cpu()], dim=1)
        # the last token of a document (not a separator / padding, whose doc id is -1)
        in_doc = left["doc_ids"] >= 0
        last = (in_doc.long() * torch.arange(in_doc.shape[1])).argmax(dim=1, keepdim=True)
        last_doc = torch.gather(left["doc_ids"], 1, last).expand(-1, total_new)
        last_pos = torch.gather(left["doc_positions"], 1, last) + torch.arange(1, total_new + 1)
        continued = {  # the whole sequences, prompt then continuation
            "input_ids": gen.sequences.cpu(),
            "doc_ids": torch.cat([left["doc_ids"], last_doc], dim=1),
            "doc_positions": torch.cat([left["doc_positions"], last_pos], dim=1),
            "seq_ids": batch["seq_ids"].cpu(),
        }
        acts = {name: value[rows_mask.to(value.device)] for name, value in gen.activations.items()}
        return acts, token_columns(continued, rows_mask)

    @property
    def new_tokens(self) -> int:
        """The tokens greedy decoding adds after each sequence (`--generate N`)."""
        return self.cfg.generate


def _left_aligned(batch: Mapping[str, Tensor], keep: Tensor) -> dict[str, Tensor]:
    """The batch's columns (on the CPU) with each row's padding moved to its front: packed rows are
    right-padded (if at all), and a decoder continues after the last column."""
    mask = batch["attention_mask"].bool().cpu()
    order = torch.argsort((~mask).long() * -1, dim=1, stable=True)  # padding first, real tokens after
    columns = {k: batch[k].cpu() for k in ("input_ids", "attention_mask", "doc_ids", "doc_positions")}
    return {k: torch.gather(v, 1, order) for k, v in {**columns, "keep": keep.cpu()}.items()}
