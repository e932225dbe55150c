"""The tokens a selection keeps. A token mask's gather: the kept tokens of a [batch, pos, ...]
activation as rows [n_tokens, ...] (`select_tokens`), and where the mask writes (`token_region`);
each row's last real token under an attention mask (`last_real`, positions="last").

One capture gathers every point with the same mask, so `KeptRows` finds the kept rows once per
device and each point is one `index_select`. Found on a GPU, they wait for the device (the count of
rows is needed on the host); from a mask on the CPU they are found there and sent to the device
without waiting, so a forward with such a mask never stops for the host. Where most tokens are
kept and the gather casts, the cast goes first: it makes and moves fewer bytes than
gather-then-cast, and the bits are the same (a cast is element by element, a gather moves elements
whole). Given a tensor to write into (`out=`, as torch's ops take one), the rows go there. Where it
casts on the CPU and the kept rows come in long runs (a packed batch drops only each document's
first tokens), each run is one copy that casts on the way, on the calling thread alone
(`one_thread`): one pass and no intermediate tensor, and no wake-up of the intra-op threads for each
small copy (measured in bench/HISTORY.md, "Extraction with a free forward on the CPU").
"""

from __future__ import annotations

import torch
from torch import Tensor

from .errors import SelectionError
from .one_thread import one_thread

_RUN_ROWS = 256  # kept rows per run, on average, from which a gather into a buffer copies run by run


class KeptRows:
    """The row-major indices of the True tokens of a [batch, pos] mask, per device."""

    def __init__(self) -> None:
        self._rows: dict[torch.device, tuple[int | None, Tensor]] = {}
        self._runs: list[tuple[int, int, int]] | None = None  # of the CPU rows, found on demand

    def of(self, mask: Tensor, device: torch.device) -> Tensor:
        version = None if mask.is_inference() else mask._version  # a mask changed in place is read anew
        found = self._rows.get(device)
        if found is None or found[0] is None or found[0] != version:
            if mask.device.type == "cpu" and device.type != "cpu":
                rows = self.of(mask, mask.device)
                if device.type == "cuda":  # page-locked, so the copy leaves the host at once
                    rows = rows.pin_memory()
                rows = rows.to(device, non_blocking=True)
            else:
                rows = mask.to(device).flatten().nonzero().squeeze(1)
            found = self._rows[device] = (version, rows)
            self._runs = None
        return found[1]

    def runs(self, mask: Tensor) -> list[tuple[int, int, int]]:
        """The kept rows of a CPU `mask` as runs of consecutive ones: (first row, first kept row, length)."""
        rows = self.of(mask, torch.device("cpu"))
        if self._runs is None and not rows.numel():
            self._runs = []
        elif self._runs is None:
            starts = [0, *(torch.nonzero(rows.diff() != 1).squeeze(1) + 1).tolist()]
            lengths = [end - start for start, end in zip(starts, [*starts[1:], rows.numel()], strict=True)]
            self._runs = list(zip(rows[torch.tensor(starts)].tolist(), starts, lengths, strict=True))
        return self._runs


def select_tokens(
    x: Tensor,
    mask: Tensor,
    pos_dim: int | None,
    kept: KeptRows,
    cast: torch.dtype | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """Keep the tokens where mask [batch, pos] is True, as rows; cast to `cast` on the way when
    that is cheaper before the gather (else the caller casts the rows). `out`: a tensor of the kept
    rows' shape to write them into (its dtype wins over `cast`); it is returned, filled, except
    for an expanded `x` (batch and pos not one dimension), whose rows are gathered anew."""
    if pos_dim is None or pos_dim % x.ndim != 1:
        raise SelectionError("token_mask needs a [batch, pos, ...] activation")
    if x.shape[0] == 1 and mask.shape[0] > 1:
        x = x.expand(mask.shape[0], *x.shape[1:])  # batch-shared points (HF position embeddings)
    if tuple(mask.shape) != tuple(x.shape[:2]):
        raise SelectionError(
            f"token_mask must be a bool tensor of shape {tuple(x.shape[:2])} (batch, pos), "
            f"got {mask.dtype} {tuple(mask.shape)}"
        )
    if x.shape[0] > 1 and x.stride(0) != x.stride(1) * x.shape[1]:  # batch and pos not one dim (expanded)
        return x[mask.to(x.device)]
    rows = kept.of(mask, x.device)
    if out is not None and tuple(out.shape) != (rows.numel(), *x.shape[2:]):
        raise SelectionError(
            f"out= has shape {tuple(out.shape)}; the kept rows need {(rows.numel(), *x.shape[2:])}"
        )
    dtype = (cast or x.dtype) if out is None else out.dtype
    if dtype != x.dtype and x.device.type == "cpu" and mask.device.type == "cpu":
        runs = kept.runs(mask)
        if len(runs) * _RUN_ROWS <= rows.numel():  # long runs: each one copy, cast on the way
            out = torch.empty((rows.numel(), *x.shape[2:]), dtype=dtype) if out is None else out
            flat = x.flatten(0, 1)
            with one_thread():  # the other cores run the forward: splitting each copy costs more
                for first, at, length in runs:
                    out[at : at + length].copy_(flat[first : first + length])
            return out
    if cast is not None and x.dtype != cast and 2 * rows.numel() > mask.numel():
        x = x.to(cast)  # keeps a dense x's strides (batch and pos stay one dim), else contiguous
    flat = x.flatten(0, 1)
    if out is None:
        return flat.index_select(0, rows)
    if flat.dtype == out.dtype:
        return torch.index_select(flat, 0, rows, out=out)
    return out.copy_(flat.index_select(0, rows))  # few rows kept: gathered, then cast into `out`


def token_region(x: Tensor, mask: Tensor, pos_dim: int | None) -> Tensor:
    """Where a token mask writes in `x` (an edit): the [batch, pos] mask, checked against `x`."""
    if pos_dim is None:
        raise SelectionError("token_mask needs a [batch, pos, ...] activation")
    pos_dim = pos_dim % x.ndim
    if mask.shape[0] != x.shape[0] or mask.shape[1] != x.shape[pos_dim]:
        raise SelectionError(
            f"token_mask must be a bool tensor of shape {(x.shape[0], x.shape[pos_dim])} "
            f"(batch, pos), got {mask.dtype} {tuple(mask.shape)}"
        )
    return mask.to(x.device)


def last_real(attention_mask: Tensor, batch: int, size: int) -> Tensor:
    """Each row's last real (mask 1) position: [batch] indices, for left or right padding."""
    mask = attention_mask
    if not isinstance(mask, Tensor) or mask.ndim != 2 or mask.shape[0] != batch or mask.shape[1] != size:
        shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise SelectionError(
            f"positions='last': the attention mask has shape {shape}, the activation "
            f"has {batch} rows of {size} positions; pass the mask of this very batch"
        )
    real = mask != 0
    if not bool(real.any(dim=1).all()):
        raise SelectionError("positions='last': a row of the attention mask has no real token")
    # the highest index holding a real token: flip, find the first one, count back
    return size - 1 - real.flip(1).int().argmax(dim=1)
