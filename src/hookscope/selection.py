"""Which part of an activation to keep or edit: positions, heads, a token mask.

Shared by capture (what to keep) and edit (where to write). Selections are validated against
the activation's shape, so a bad one is a clear error rather than an IndexError deep in torch.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from .errors import SelectionError

Positions = None | int | slice | Sequence[int] | Tensor | str
Heads = None | int | Sequence[int] | Tensor


def _index(sel: int | Sequence[int] | Tensor, size: int, what: str, device: torch.device) -> Tensor:
    if _is_int(sel) or (isinstance(sel, (list, tuple)) and sel and all(_is_int(v) for v in sel)):
        # plain ints are checked in Python: a check on a tensor would break a torch.compile graph
        values = [int(sel)] if _is_int(sel) else [int(v) for v in sel]
        if not all(-size <= v < size for v in values):
            raise SelectionError(f"{what} selection {values} out of range for size {size}")
        return torch.tensor([v % size for v in values], dtype=torch.long, device=device)
    try:
        idx = sel if isinstance(sel, Tensor) else torch.as_tensor(sel)  # numpy arrays, nested lists
    except (TypeError, ValueError, RuntimeError, OverflowError):
        idx = None
    # no cast: it would silently turn a bool mask, floats or text into other indices
    if idx is None or idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise SelectionError(f"{what} selection {sel!r}: use an int, a non-empty list of ints or a 1-D "
                             "integer tensor")
    idx = idx.long()
    if idx.ndim != 1 or idx.numel() == 0:
        raise SelectionError(f"{what} selection must be a non-empty int or list of ints, "
                             f"got shape {tuple(idx.shape)}")
    if idx.min() < -size or idx.max() >= size:
        raise SelectionError(f"{what} selection {idx.tolist()} out of range for size {size}")
    return (idx % size).to(device)


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)  # numpy ints too, not True / False


def _check_slice(s: slice) -> None:
    bounds = (s.start, s.stop, s.step)
    if not all(v is None or _is_int(v) for v in bounds) or (s.step is not None and s.step < 1):
        raise SelectionError(f"positions={s!r}: a slice needs int bounds and a positive step (torch cannot "
                             "step back)")


def select_positions(x: Tensor, positions: Positions, pos_dim: int | None) -> Tensor:
    """Keep chosen token positions. As in Python indexing, an int (or "last", i.e. -1) drops the
    position dim and a slice or list keeps it; a LongTensor [batch] picks one position per row
    (the last real token of right-padded rows, say) and drops the dim."""
    if positions is None:
        return x
    if pos_dim is None:
        raise SelectionError("this point has no position dimension; leave positions=None")
    size = x.shape[pos_dim]
    if isinstance(positions, str):
        if positions != "last":
            raise SelectionError(f"positions={positions!r}: use 'last', an int, a slice, a list or a tensor")
        positions = -1
    if isinstance(positions, bool):
        raise SelectionError(f"positions={positions!r}: use 'last', an int, a slice, a list or a tensor")
    if _is_int(positions):
        if not -size <= positions < size:
            raise SelectionError(f"position selection {positions} out of range for size {size}")
        return x.select(pos_dim, int(positions))
    if isinstance(positions, slice):
        _check_slice(positions)
        return x[(slice(None),) * (pos_dim % x.ndim) + (positions,)]
    if isinstance(positions, Tensor) and positions.ndim == 1 and positions.numel() == x.shape[0] \
            and pos_dim % x.ndim == 1 and positions.dtype in (torch.int32, torch.int64):
        idx = _index(positions, size, "per-row position", x.device)
        return x[torch.arange(x.shape[0], device=x.device), idx]
    return x.index_select(pos_dim, _index(positions, size, "position", x.device))


def select_heads(x: Tensor, heads: Heads, head_dim: int | None) -> Tensor:
    if heads is None:
        return x
    if head_dim is None:
        raise SelectionError("this point has no head dimension: "
                             "heads= works on attn.q|k|v|z (and attn.pattern)")
    return x.index_select(head_dim, _index(heads, x.shape[head_dim], "head", x.device))


def select_tokens(x: Tensor, mask: Tensor | None, pos_dim: int | None) -> Tensor:
    """Keep the tokens where mask [batch, pos] is True, as rows: [n_tokens, ...]."""
    if mask is None:
        return x
    if not isinstance(mask, Tensor):
        raise SelectionError(f"token_mask must be a bool tensor [batch, pos], got {type(mask).__name__}")
    if pos_dim is None or pos_dim % x.ndim != 1:
        raise SelectionError("token_mask needs a [batch, pos, ...] activation")
    if x.shape[0] == 1 and mask.ndim == 2 and mask.shape[0] > 1:
        x = x.expand(mask.shape[0], *x.shape[1:])  # batch-shared points (HF position embeddings)
    if mask.dtype != torch.bool or tuple(mask.shape) != tuple(x.shape[:2]):
        raise SelectionError(
            f"token_mask must be a bool tensor of shape {tuple(x.shape[:2])} (batch, pos), "
            f"got {mask.dtype} {tuple(mask.shape)}"
        )
    return x[mask.to(x.device)]


def region_mask(x: Tensor, positions: Positions, heads: Heads, pos_dim: int | None,
                head_dim: int | None) -> Tensor:
    """A bool mask, broadcastable to x, that is True where (positions, heads) select."""
    mask = torch.ones((1,) * x.ndim, dtype=torch.bool, device=x.device)
    if positions is not None:
        if pos_dim is None:
            raise SelectionError("this point has no position dimension; leave positions=None")
        if isinstance(positions, str):
            if positions != "last":
                raise SelectionError(f"positions={positions!r}: use 'last', an int, a slice, a list")
            positions = -1
        size = x.shape[pos_dim]
        keep = torch.zeros(size, dtype=torch.bool, device=x.device)
        if isinstance(positions, slice):
            _check_slice(positions)
            keep[positions] = True
        else:
            keep[_index(positions, size, "position", x.device)] = True
        shape = [1] * x.ndim
        shape[pos_dim] = size
        mask = mask & keep.view(shape)
    if heads is not None:
        if head_dim is None:
            raise SelectionError("this point has no head dimension: heads= works on per-head points")
        size = x.shape[head_dim]
        keep = torch.zeros(size, dtype=torch.bool, device=x.device)
        keep[_index(heads, size, "head", x.device)] = True
        shape = [1] * x.ndim
        shape[head_dim] = size
        mask = mask & keep.view(shape)
    return mask
