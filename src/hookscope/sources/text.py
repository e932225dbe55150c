"""Packed text: documents (documents.py) -> token sequences of `--context` (packing.py) ->
batches of `--batch-size`; one row per kept token (real tokens, less BOS / CLS / SEP unless
`--keep-bos`). `--max-tokens` caps the tokens packed, in whole sequences."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from torch import Tensor

from ..errors import HookscopeError
from ..extract_config import ExtractConfig, Run
from ..loading import Loaded, tokenizer_hash
from ..model_inputs import max_positions
from .base import Rows, Source
from .columns import token_columns
from .documents import iter_documents
from .fingerprint import ReadMeter, source_chars, source_fingerprint
from .identity import model_identity, point_meanings
from .packing import pack_batches, pack_policy

DEFAULT_CONTEXT = 128


class TextSource(Source):
    """Any text source documents.py reads; the fallback when no other kind claims `--data`."""

    bound_by_data = "bound by tokenization: raise --workers"

    @classmethod
    def claims(cls, cfg: ExtractConfig) -> bool:
        return True

    @classmethod
    def open(cls, cfg: ExtractConfig, loaded: Loaded, points: list[str], run: Run) -> TextSource:
        context = cfg.context or DEFAULT_CONTEXT
        longest = max_positions(loaded.model)
        if longest is not None and context > longest:
            raise HookscopeError(
                f"context {context} is longer than the model's {longest} positions; use "
                f"--context {longest} or less"
            )
        return cls(cfg, loaded, points, context, run)

    def __init__(self, cfg: ExtractConfig, loaded: Loaded, points: list[str], context: int, run: Run):
        self.cfg, self.loaded, self.points, self.context = cfg, loaded, points, context
        self.meter = ReadMeter(
            iter_documents(cfg.data, text_field=cfg.text_field), source_chars(cfg.data), workers=cfg.workers
        )
        # progress: the tokens packed so far and the last document they reach into
        self.tokens, self.last_doc = 0, -1
        self.budget = (
            None
            if cfg.max_tokens is None  # the tokens of this rank (whole sequences only)
            else cfg.max_tokens // context * context / run.world_size
        )

    def settings(self) -> dict[str, Any]:
        """Everything that shapes the stored rows. The number of processes does not: a store started
        by N processes is finished by M. A resume compares these with the store's key for key, so a
        key renamed or added here would refuse every text store already written."""
        cfg, loaded = self.cfg, self.loaded
        return {
            **{"model": loaded.name, "revision": cfg.revision, **model_identity(loaded)},
            "tokenizer_sha256": tokenizer_hash(loaded.tokenizer),
            "points": self.points,
            "dtype": cfg.dtype,
            "context": self.context,
            "batch_size": cfg.batch_size,
            "drop_bos": cfg.drop_bos,
            "packing": pack_policy(loaded.tokenizer).as_dict(),
            "data": cfg.data,
            "data_fingerprint": source_fingerprint(cfg.data, text_field=cfg.text_field),  # contents, hashed
            # the builtin corpus is this Python's own docstrings: another version, another corpus
            "python": list(sys.version_info[:2]) if cfg.data.startswith("builtin:") else None,
            "text_field": cfg.text_field,
            **point_meanings(loaded, self.points),
        }

    def batches(self) -> Iterator[dict[str, Tensor]]:
        return pack_batches(
            self.meter,
            self.loaded.tokenizer,
            context=self.context,
            batch_size=self.cfg.batch_size,
            max_tokens=self.cfg.max_tokens,
            workers=self.cfg.workers,
        )

    def keep(self, batch: dict[str, Tensor]) -> Tensor:
        """The tokens of a batch that become rows: real tokens, less BOS / CLS / SEP unless kept."""
        keep = batch["attention_mask"].bool()
        if self.cfg.drop_bos:
            keep &= ~batch["special_mask"].bool()
        return keep

    def model_call(self, batch: dict[str, Tensor]) -> tuple[dict[str, Tensor], Tensor | None]:
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}, self.keep(batch)

    def rows(self, batch: dict[str, Tensor], acts: dict[str, Tensor]) -> Rows:
        return acts, token_columns(batch, self.keep(batch))

    def columns(self, batch: dict[str, Tensor], keep: Tensor | None) -> dict[str, Tensor] | None:
        return token_columns(batch, self.keep(batch) if keep is None else keep)

    def item_tokens(self) -> int:
        return self.context

    def rows_in(self, batch: dict[str, Tensor]) -> int:
        return int(self.keep(batch).sum())

    def estimate(self, rows: int, batch: dict[str, Tensor]) -> int | None:
        """Rows in all, from --max-tokens (rows per token so far) and from the share of the source
        packed up to this batch's last document; the lower of the two."""
        self.tokens += int(batch["attention_mask"].sum())
        self.last_doc = max(self.last_doc, int(batch["doc_ids"].max()))
        estimates = []
        if self.budget is not None and self.tokens:
            estimates.append(rows * self.budget / self.tokens)
        fraction = self.meter.fraction(self.last_doc if self.last_doc >= 0 else None)
        if fraction:
            estimates.append(rows / fraction)
        return int(min(estimates)) if estimates else None

    def nothing_to_extract(self) -> str:
        return f"data source {self.cfg.data!r} gives no tokens to extract; point --data at some text"
