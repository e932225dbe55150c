"""The per-row columns of a store, built here for every source: each row traces back to where it
came from. Text rows carry `token_ids`, `doc_ids` (the document's index in the source),
`positions` (the token's index in its document) and `seq_ids` (the packed sequence); image rows
carry `doc_ids` (the image's index), `positions` (the token's index in the image's sequence) and
`patch_rows` / `patch_cols` (the patch's place in the grid, -1 for CLS / register tokens)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import HookscopeError


def token_columns(batch: dict[str, Tensor], keep: Tensor) -> dict[str, Tensor]:
    """The columns of the kept tokens (`keep`, [batch, context]) of a packed batch, row-major: the
    kept positions found once, then one `index_select` per column (a boolean mask would find them
    again for each)."""
    kept = keep.flatten().nonzero().squeeze(1)
    return {
        "token_ids": batch["input_ids"].flatten().index_select(0, kept),
        "doc_ids": batch["doc_ids"].flatten().index_select(0, kept),
        "positions": batch["doc_positions"].flatten().index_select(0, kept),
        "seq_ids": batch["seq_ids"].index_select(0, kept // keep.shape[1]),
    }


def patch_columns(images: list[int], n_tokens: int, grid: tuple[int, int]) -> dict[str, Tensor]:
    """The columns of every token of `images` (indices), each `n_tokens` long: prefix tokens, then
    the `grid` (rows, cols) of patches row-major."""
    rows, cols = grid
    prefix = n_tokens - rows * cols
    if prefix < 0:
        raise HookscopeError(f"{n_tokens} tokens but a {rows}x{cols} patch grid: the point is not per patch")
    patch = torch.arange(n_tokens) - prefix
    per_image = {
        "positions": torch.arange(n_tokens),
        "patch_rows": torch.where(patch >= 0, patch // cols, -1),
        "patch_cols": torch.where(patch >= 0, patch % cols, -1),
    }
    return {
        "doc_ids": torch.tensor(images).repeat_interleave(n_tokens),
        **{k: v.repeat(len(images)) for k, v in per_image.items()},
    }
