"""Which part of an activation to keep or edit: one frozen `Selection` value.

    sel = Selection.of(positions="last", heads=[0, 2], dtype=torch.bfloat16, device="cpu")
    kept = sel.take(act, spec, attention_mask=mask)     # capture: what to keep, as a copy
    where = sel.region(act, spec)                        # edit: a bool mask of where to write

`Selection.of` parses and checks the raw options once, with one error wording, so capture, edits
and generation all accept (and refuse) the same things. What depends on the activation (a range
against its size, a token mask against its shape) is checked in `take` / `region`, so a bad
selection is a clear `SelectionError` rather than an IndexError deep in torch.

`positions="last"` is each row's last real token when an attention mask is known (given to the
capture, or passed to the model as `attention_mask=`), for left and right padding alike; with no
mask it is the last position (-1). On an encoder such as BERT the last real token is `[SEP]`
(the first, position 0, is `[CLS]`).

A generation step runs the model on the positions from some sequence position on (the KV cache
holds the earlier ones): `sel.at(offset)` reads positions as counted from the sequence's start on
such a pass, in `take`, `region` and `window`; `tail` says how many last positions a selection
counted from the end needs once the sequence is complete.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from .errors import SelectionError
from .token_rows import KeptRows, last_real, select_tokens, token_region

Positions = None | int | slice | Sequence[int] | Tensor | str
Heads = None | int | Sequence[int] | Tensor

_POSITIONS_HELP = "use 'last', an int, a slice, a non-empty list of ints or a 1-D integer tensor"
_HEADS_HELP = "use an int, a non-empty list of ints or a 1-D integer tensor"
_NO_HEADS = "this point has no head dimension: heads= works on attn.q|k|v|z (and attn.pattern)"
_NO_POSITIONS = "this point has no position dimension; leave positions=None"


class Dims(Protocol):
    """Where the position and head dims of a point are (a `PointSpec` is one)."""

    pos_dim: int | None
    head_dim: int | None


@dataclass(frozen=True, eq=False)
class Selection:
    """Positions, heads or a token mask to keep, and the dtype / device to keep them in.
    Build it with `Selection.of(...)`, which checks every option.

    Raises:
        SelectionError: from `of`, a bad option; from `take`, one that does not fit the activation."""

    positions: Positions = None  # ints / lists are stored as tuples; "last" stays a string
    heads: Heads = None
    token_mask: Tensor | None = None
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    offset: int | None = None  # from `at`: the activation's position 0 is this sequence position
    # the token mask's kept rows, found once for every point of a capture
    _kept_rows: KeptRows = field(default_factory=KeptRows, init=False, repr=False, compare=False)
    # the heads' index and region per shape: one selection serves every step of a generation
    _heads_made: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def of(
        cls,
        positions: Positions = None,
        heads: Heads = None,
        token_mask: Tensor | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> Selection:
        if positions is None and heads is None and token_mask is None and dtype is None and device is None:
            return EVERYTHING  # frozen, so one value serves every capture that keeps everything
        if token_mask is not None and positions is not None:
            raise SelectionError("give either positions= or token_mask=, not both")
        if token_mask is not None and (
            not isinstance(token_mask, Tensor) or token_mask.dtype != torch.bool or token_mask.ndim != 2
        ):
            raise SelectionError(
                "token_mask must be a bool tensor [batch, pos], got "
                + (
                    f"{token_mask.dtype} {tuple(token_mask.shape)}"
                    if isinstance(token_mask, Tensor)
                    else type(token_mask).__name__
                )
            )
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise SelectionError(f"dtype={dtype!r}: use a torch.dtype such as torch.bfloat16")
        return cls(
            _parse(positions, "position", _POSITIONS_HELP),
            _parse(heads, "head", _HEADS_HELP),
            token_mask,
            dtype,
            torch.device(device) if device is not None else None,
        )

    def at(self, offset: int) -> Selection:
        """This selection on a pass over the sequence positions from `offset` on (a generation step):
        `take`, `region` and `window` then count positions from the sequence's start."""
        return Selection(self.positions, self.heads, self.token_mask, self.dtype, self.device, offset)

    def from_start(self, what: str) -> Selection:
        """Itself, if its positions count from the sequence's start; else a `SelectionError` about
        `what`: before a generated sequence ends, its end is not known."""
        p = self.positions
        values = (
            ()
            if p is None or isinstance(p, str)
            else (p.start, p.stop)
            if isinstance(p, slice)
            else _values(p)
        )
        if isinstance(p, str) or any(v is not None and v < 0 for v in values):
            raise SelectionError(
                f"{what}: positions={_short(p)} counts from the end of the sequence, which "
                "has no meaning before the sequence ends; give positions counted from the "
                "start (ints >= 0, a slice with non-negative bounds)"
            )
        return self

    @property
    def tail(self) -> int:
        """How many of the sequence's last positions the positions name counting from its end (a
        negative index, "last", a negative slice start): what a capture made pass by pass holds back
        until the sequence ends."""
        p = self.positions
        if p is None or isinstance(p, str):
            return 0 if p is None else 1
        return max(0, -(p.start or 0)) if isinstance(p, slice) else max(0, -min(_values(p)))

    def window(self, size: int) -> Tensor:
        """[size] bool: which positions of a pass over sequence positions [offset, offset + size) the
        positions name counting from the start (every one it may name, for a slice with a bound
        counted from the end); positions counted from the end alone name none (see `tail`)."""
        seq, p = range(self.offset or 0, (self.offset or 0) + size), self.positions
        if p is None or isinstance(p, str):
            return torch.full((size,), p is None, dtype=torch.bool)
        if not isinstance(p, slice):  # (Python, not tensor ops: a step covers a position or a few)
            named = {v for v in _values(p) if v >= 0}
            return torch.tensor([q in named for q in seq], dtype=torch.bool)
        first, stop, step = p.start or 0, p.stop, p.step or 1
        if first < 0:  # a start known only at the end: within the tail, or anywhere before `stop`
            first, step = 0, 1
            if stop is None or stop < 0:
                return torch.zeros(size, dtype=torch.bool)
        end = stop if stop is not None and stop >= 0 else seq.stop
        return torch.tensor([first <= q < end and (q - first) % step == 0 for q in seq], dtype=torch.bool)

    def check_dims(self, spec: Dims) -> None:
        """Refuse a selection naming a dim the point lacks (heads on a point without heads, positions
        on one without positions) with `take`'s words, before any activation is seen: where the
        activations are taken in another process (a vLLM worker), an error there would stop it."""
        if self.heads is not None and spec.head_dim is None:
            raise SelectionError(_NO_HEADS)
        if self.positions is not None and spec.pos_dim is None:
            raise SelectionError(_NO_POSITIONS)

    @property
    def wants_attention_mask(self) -> bool:
        """Whether `take` reads the attention mask (only "last" depends on padding)."""
        return isinstance(self.positions, str)

    # capture: what to keep ---------------------------------------------------------------------

    def take(
        self,
        act: Tensor,
        spec: Dims,
        *,
        attention_mask: Tensor | None = None,
        copy: bool = True,
        non_blocking: bool = False,
    ) -> Tensor:
        """The selected part of `act`, cast and moved, and never a view of `act`.

        copy: whether to copy what the selections left a view of (or `act` itself); False hands
        back what they made (the caller owns `act`). Whether a selection made memory of its own is
        known from the ops it ran, not read from storages, so this runs inside a compiled graph too.
        non_blocking: a move from a CUDA device to the host goes into page-locked memory without
        waiting for the device; the caller synchronises (an event, `torch.cuda.synchronize`)
        before the value is read."""
        if self is EVERYTHING:  # (the common case: no selection to make, only the copy)
            return act.clone() if copy else act
        cast = self.dtype if self.dtype is not None and act.is_floating_point() else None
        x, fresh = self._select(act, spec, attention_mask, cast)
        fresh = fresh or not copy
        # integer points (router indices, expert token indices) keep their dtype: a float cast
        # would silently round indices above 256 in bfloat16
        if cast is not None and x.dtype != cast and x.is_floating_point():
            x, fresh = x.to(cast), True  # cast on the device, before the copy: fewer bytes to move
        if self.device is not None and x.device != self.device:
            return _to_device(x, self.device, non_blocking)
        return x if fresh else x.clone()  # never keep a view: a later in-place op would rewrite it

    def select(self, act: Tensor, spec: Dims, *, attention_mask: Tensor | None = None) -> Tensor:
        """Heads, then positions or the token mask (no cast, no copy)."""
        return self._select(act, spec, attention_mask, None)[0]

    def _select(
        self,
        act: Tensor,
        spec: Dims,
        attention_mask: Tensor | None,
        cast: torch.dtype | None,
    ) -> tuple[Tensor, bool]:
        """`select`, and whether its result is memory of its own (False: `act` or a view of it); a
        token mask's gather may cast to `cast` on the way (whichever order moves fewer bytes: the
        same bits either way, a cast is element by element)."""
        x, fresh = act, False
        if self.heads is not None:
            if spec.head_dim is None:
                raise SelectionError(_NO_HEADS)
            head_dim = spec.head_dim % x.ndim
            x = x.index_select(head_dim, self._heads(x.shape[head_dim], x.ndim, head_dim, x.device)[0])
            fresh = True
        if self.token_mask is not None:
            return select_tokens(x, self.token_mask, spec.pos_dim, self._kept_rows, cast), True
        if self.positions is None:
            return x, fresh
        pos_dim = _pos_dim(spec, x)
        size = x.shape[pos_dim]
        positions = self.positions if self.offset is None else self._local(size)
        if isinstance(positions, str):  # "last"
            if attention_mask is None:
                positions = -1
            else:
                return _per_row(x, last_real(attention_mask, x.shape[0], size), pos_dim), True
        if _is_int(positions):  # a view
            _check_range([positions], size, "position")
            return x.select(pos_dim, int(positions)), fresh
        if isinstance(positions, slice):  # a view
            return x[(slice(None),) * pos_dim + (positions,)], fresh
        if (
            isinstance(positions, Tensor)
            and positions.ndim == 1
            and positions.numel() == x.shape[0]
            and pos_dim == 1
        ):
            # one position per row (an explicit [batch] LongTensor)
            return _per_row(x, _index(positions, size, "per-row position", x.device), pos_dim), True
        return x.index_select(pos_dim, _index(positions, size, "position", x.device)), True

    def _local(self, size: int) -> int | slice | tuple[int, ...] | Tensor:
        """The positions as indices into a pass over sequence positions [offset, offset + size)."""
        p, offset = self.from_start("a selection at an offset").positions, self.offset
        if isinstance(p, slice):
            first, step = p.start or 0, p.step or 1
            start = first - offset if offset <= first else (first - offset) % step
            return slice(start, None if p.stop is None else max(0, p.stop - offset), step)
        values = [v - offset for v in _values(p)]
        if not all(0 <= v < size for v in values):
            raise SelectionError(
                f"positions {_values(p)} are not all in this pass, which covers sequence "
                f"positions [{offset}, {offset + size})"
            )
        return p - offset if isinstance(p, Tensor) else values[0] if _is_int(p) else tuple(values)

    def split(self) -> tuple[Selection, Selection]:
        """(first, rest): `first` holds what a compiled graph can do (selections given as Python
        values, and the cast); `rest` the data-dependent selections (a tensor, a token mask,
        padding-aware "last") and the move to the device. `rest.take(first.take(x))` keeps what
        `take(x)` keeps."""
        heads_static = not isinstance(self.heads, Tensor)
        pos_static = (
            heads_static and self.token_mask is None and not isinstance(self.positions, (Tensor, str))
        )
        first = Selection(
            self.positions if pos_static else None,
            self.heads if heads_static else None,
            None,
            self.dtype,
            None,
            self.offset if pos_static else None,
        )
        rest = Selection(
            None if pos_static else self.positions,
            None if heads_static else self.heads,
            self.token_mask,
            None,
            self.device,
            None if pos_static else self.offset,
        )
        return first, rest

    def rows_apart(self) -> tuple[Selection, Selection] | None:
        """(rows, rest): the positions or token mask alone, and the heads, cast and move; None where
        no rows are selected. For a view that reads each row alone along the trailing dims,
        `rest.take(view(rows.select(raw)))` keeps what `take(view(raw))` keeps (`rest` reading the
        head dim as it is once the rows are picked)."""
        if self.positions is None and self.token_mask is None:
            return None
        rows = Selection(self.positions, None, self.token_mask, None, None, self.offset)
        return rows, Selection(None, self.heads, None, self.dtype, self.device)

    # edits: where to write ---------------------------------------------------------------------

    def region(self, act: Tensor, spec: Dims, *, attention_mask: Tensor | None = None) -> Tensor:
        """A bool mask, broadcastable to `act`, that is True where (positions, heads) select."""
        if self.token_mask is not None:
            return self._mask_along(token_region(act, self.token_mask, spec.pos_dim), act, spec)
        mask: Tensor | None = None  # (None: everything so far)
        if self.positions is not None:
            pos_dim = _pos_dim(spec, act)
            size = act.shape[pos_dim]
            positions = self.positions
            if self.offset is not None:
                keep = self.from_start("an edit at an offset").window(size).to(act.device)
                mask = _along(keep, act.ndim, pos_dim)
            elif isinstance(positions, str) and attention_mask is not None:
                rows = last_real(attention_mask, act.shape[0], size).to(act.device)
                keep = torch.zeros(act.shape[0], size, dtype=torch.bool, device=act.device)
                keep[torch.arange(act.shape[0], device=act.device), rows] = True
                mask = self._mask_along(keep, act, spec)
            else:
                keep = torch.zeros(size, dtype=torch.bool, device=act.device)
                if isinstance(positions, slice):
                    keep[positions] = True
                else:
                    keep[
                        _index(-1 if isinstance(positions, str) else positions, size, "position", act.device)
                    ] = True
                mask = _along(keep, act.ndim, pos_dim)
        if self.heads is not None:
            if spec.head_dim is None:
                raise SelectionError(_NO_HEADS)
            head_dim = spec.head_dim % act.ndim
            heads = self._heads(act.shape[head_dim], act.ndim, head_dim, act.device)[1]
            mask = heads if mask is None else mask & heads
        return torch.ones((1,) * act.ndim, dtype=torch.bool, device=act.device) if mask is None else mask

    def _heads(self, size: int, ndim: int, head_dim: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """(the heads' index along a head dim of `size`, a bool mask True at them along `head_dim` of
        an `ndim`-dim activation), read only: made once per shape for heads given as Python values
        (one selection serves every step of a generation), outside inference mode so that a pass
        recording gradients may use them too; afresh for a tensor, or in a compiled graph."""
        cached = not isinstance(self.heads, Tensor) and not torch.compiler.is_compiling()
        key = (size, ndim, head_dim, device)
        if cached and key in self._heads_made:
            return self._heads_made[key]
        with torch.inference_mode(False) if cached else contextlib.nullcontext():
            index = _index(self.heads, size, "head", device)
            keep = torch.zeros(size, dtype=torch.bool, device=device).index_fill_(0, index, True)
        made = (index, _along(keep, ndim, head_dim))
        if cached:
            self._heads_made[key] = made
        return made

    @staticmethod
    def _mask_along(keep: Tensor, act: Tensor, spec: Dims) -> Tensor:
        """A [batch, pos] mask shaped to broadcast against `act` (batch dim 0, pos at pos_dim)."""
        pos_dim = _pos_dim(spec, act)
        shape = [1] * act.ndim
        shape[0], shape[pos_dim] = keep.shape
        return keep.view(shape)


# --- parsing (once, in `Selection.of`) ---------------------------------------------------------


def _parse(sel: Any, what: str, help_text: str) -> Any:
    if sel is None:
        return None
    if isinstance(sel, str):
        if what == "position" and sel == "last":
            return sel
        raise SelectionError(f"{what}s={sel!r}: {help_text}")
    if isinstance(sel, bool):
        raise SelectionError(f"{what}s={sel!r}: {help_text}")
    if _is_int(sel):
        return int(sel)
    if isinstance(sel, slice):
        if what != "position":
            raise SelectionError(f"{what}s={sel!r}: {help_text}")
        bounds = (sel.start, sel.stop, sel.step)
        if not all(v is None or _is_int(v) for v in bounds) or (sel.step is not None and sel.step < 1):
            raise SelectionError(
                f"{what}s={sel!r}: a slice needs int bounds and a positive step (torch cannot step back)"
            )
        return sel
    if isinstance(sel, (list, tuple)) and sel and all(_is_int(v) for v in sel):
        return tuple(int(v) for v in sel)
    return _parse_index(sel, what, help_text)


def _parse_index(sel: Any, what: str, help_text: str) -> Tensor:
    """A selection given as a tensor, an array or a nested list: a 1-D integer index."""
    try:
        idx = sel if isinstance(sel, Tensor) else torch.as_tensor(sel)  # numpy arrays, nested lists
    except (TypeError, ValueError, RuntimeError, OverflowError):
        idx = None
    # no cast: it would silently turn a bool mask, floats or text into other indices
    if idx is None or idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise SelectionError(f"{what}s={_short(sel)}: {help_text}")
    if idx.ndim != 1 or idx.numel() == 0:
        raise SelectionError(f"{what}s: got shape {tuple(idx.shape)}; {help_text}")
    return idx.long()


def _short(sel: Any) -> str:
    return repr(sel) if len(repr(sel)) < 80 else repr(sel)[:77] + "..."


def _values(positions: int | tuple[int, ...] | Tensor) -> list[int]:
    """Parsed int / tuple / tensor positions as a list of ints."""
    if isinstance(positions, Tensor):
        return positions.flatten().tolist()
    return [int(positions)] if _is_int(positions) else list(positions)


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)  # numpy ints too, not True / False


# --- checks against the activation -------------------------------------------------------------


def _check_range(values: Sequence[int], size: int, what: str) -> None:
    if not all(-size <= v < size for v in values):
        raise SelectionError(f"{what} selection {list(values)} out of range for size {size}")


def _index(sel: int | tuple[int, ...] | Tensor, size: int, what: str, device: torch.device) -> Tensor:
    if not isinstance(sel, Tensor):
        # plain ints are checked in Python: a check on a tensor would break a torch.compile graph
        values = _values(sel)
        _check_range(values, size, what)
        return torch.tensor([v % size for v in values], dtype=torch.long, device=device)
    if sel.min() < -size or sel.max() >= size:
        raise SelectionError(f"{what} selection {sel.tolist()} out of range for size {size}")
    return (sel % size).to(device)


def _pos_dim(spec: Dims, x: Tensor) -> int:
    if spec.pos_dim is None:
        raise SelectionError(_NO_POSITIONS)
    return spec.pos_dim % x.ndim


def _along(keep: Tensor, ndim: int, dim: int) -> Tensor:
    shape = [1] * ndim
    shape[dim] = keep.numel()
    return keep.view(shape)


def _per_row(x: Tensor, rows: Tensor, pos_dim: int) -> Tensor:
    """x with one position per batch row (rows: [batch] indices); the position dim is dropped."""
    rows = rows.to(x.device)
    if x.shape[0] == 1 and rows.numel() > 1:
        x = x.expand(rows.numel(), *x.shape[1:])  # batch-shared points (HF position embeddings)
    return x.movedim(pos_dim, 1)[torch.arange(x.shape[0], device=x.device), rows]


def _to_device(x: Tensor, device: torch.device, non_blocking: bool) -> Tensor:
    if non_blocking and x.is_cuda and device.type == "cpu":
        # page-locked, so the copy leaves the device without the host waiting for it
        buf = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        return buf.copy_(x, non_blocking=True)
    return x.to(device, non_blocking=non_blocking, copy=True)


EVERYTHING = Selection()  # keeps every position and head, as computed
