"""Packed text plus the model's own continuation (`--generate N`): each packed sequence's kept
tokens, then the N tokens greedy decoding adds after it (up to and including EOS), all through
`generate_rows`. Greedy decoding is deterministic, so a resumed extraction regenerates the same
rows. Not streamable: every step needs every block."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..errors import HookscopeError
from ..generate import generate_rows
from ..inputs import max_positions
from .base import Rows, Run
from .text import TextSource

if TYPE_CHECKING:
    from ..extract import ExtractConfig
    from ..models import Loaded


class GeneratedSource(TextSource):
    streamable = False

    @classmethod
    def claims(cls, cfg: ExtractConfig) -> bool:
        return bool(cfg.generate)

    @classmethod
    def open(cls, cfg: ExtractConfig, loaded: Loaded, points: list[str], run: Run) -> TextSource:
        source = super().open(cfg, loaded, points, run)
        longest = max_positions(loaded.model)
        if longest is not None and source.context + cfg.generate > longest:
            raise HookscopeError(f"--context {source.context} + --generate {cfg.generate} is longer than the "
                                 f"model's {longest} positions; lower one of them")
        return source

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "generate": self.cfg.generate}

    def compute(self, model: torch.nn.Module, batch: dict[str, Tensor], points: Sequence[str],
                dtype: torch.dtype, device: str) -> Rows:
        inputs, keep = self.model_call(batch)
        inputs = {k: v.to(device) for k, v in inputs.items()}
        return generate_rows(model, {**batch, **inputs}, points, self.cfg.generate, keep.to(device),
                             dtype=dtype)
