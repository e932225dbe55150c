"""Interventions by point name: ablate, patch, steer. Each is a small value object; `hs.edit`
attaches any number of them for the length of a `with` block, and composes with `hs.capture`:

    clean = hs.collect(model, clean_ids, "blocks.4.attn.z")
    with hs.edit(model, hs.patch("blocks.4.attn.z", clean, heads=[2]),
                 hs.steer("blocks.6.resid_post", vector, scale=4.0)):
        logits = model(corrupt_ids)

Edits write new tensors (never in place), so they are safe under autograd and the model's own
activations are left untouched.

During generation (`hs.generate`) each forward pass covers a few sequence positions from some
offset on; `edit.step(offset, size)` is the edit on such a pass, decided eagerly before it runs
(what it writes, and a patch's source at those positions), so that the hook itself reads only
tensors and one compiled graph serves every step.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .arch import PointSpec, arch_of
from .errors import SelectionError
from .hooks import Hook, Hooks
from .names import find_key
from .selection import Heads, Positions, Selection


@dataclass(frozen=True)
class Edit:
    """Replace the selected region of a point's activation with `value(act, spec)`. An edit is a
    hook function, `edit(act, hook) -> new act`, usable with `Hooks.forward` as it is.

    The base of `Ablate`, `Patch` and `Steer`; a new kind of edit is a subclass that defines `value`.

    Attributes:
        point: the point it edits.
        positions: the positions it writes (None: all of them).
        heads: the heads it writes, on per-head points (None: all of them).

    Raises:
        SelectionError: positions or heads that do not fit the point (when the edit is built or runs)."""

    point: str
    positions: Positions = None
    heads: Heads = None
    selection: Selection = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "selection", Selection.of(self.positions, self.heads))

    def value(self, act: Tensor, spec: PointSpec, part: Tensor | None = None) -> Tensor:
        """What the selected region becomes. `part`: what a generation step reads of the edit's
        own data (see `part_at`), else None."""
        raise NotImplementedError

    def __call__(self, act: Tensor, hook: Hook, *, attention_mask: Tensor | None = None) -> Tensor:
        spec = hook.spec
        if self.positions is None and self.heads is None:
            return self.write(act, spec, None)
        return self.write(act, spec, self.selection.region(act, spec, attention_mask=attention_mask))

    def write(self, act: Tensor, spec: PointSpec, where: Tensor | None, part: Tensor | None = None) -> Tensor:
        """`act` with `value` written where the bool mask `where` is True (everywhere for None)."""
        # (no `part` unless a step has one: an Edit subclass written as `value(act, spec)` keeps working)
        new = self.value(act, spec) if part is None else self.value(act, spec, part)
        if new.dtype != act.dtype:  # (a no-op `.to` is still a dispatch: per generated token, it shows)
            new = new.to(act.dtype)
        if where is None:
            return new.expand_as(act) if new.shape != act.shape else new
        return torch.where(where, new, act)

    def step(self, offset: int, size: int, allowed: Tensor | None = None) -> EditStep | None:
        """This edit on a forward pass over sequence positions [offset, offset + size) (a generation
        step), or None where it writes nothing there. `allowed` ([size] bool) narrows the positions
        further. Positions must count from the start (`Selection.from_start`)."""
        if allowed is None and self.selection.positions is None and type(self).part_at is Edit.part_at:
            return self._every_position  # nothing here depends on the pass: decided once
        keep = self.selection.at(offset).window(size)
        if allowed is not None:
            keep = keep & allowed
        written = int(keep.sum())
        if written == 0:
            return None
        where = None if written == size else keep
        return EditStep(self, where, self._heads_selection, self.part_at(offset, size, keep))

    @functools.cached_property
    def _every_position(self) -> EditStep:
        """The step of an edit on every position that reads nothing position-bound (a steer, an
        ablation): the same on every pass of a generation."""
        return EditStep(self, None, self._heads_selection, None)

    @functools.cached_property
    def _heads_selection(self) -> Selection | None:
        """The heads alone, one selection for every pass (it makes their index and region once)."""
        return None if self.heads is None else Selection(heads=self.selection.heads)

    def part_at(self, offset: int, size: int, keep: Tensor) -> Tensor | None:
        """What `value` reads of the edit's own data on a pass over [offset, offset + size), where
        `keep` ([size] bool) is written; None when it reads nothing position-bound."""
        return None


@dataclass(frozen=True)
class EditStep:
    """An edit on one generation step's forward pass, called as the hook: the positions it writes
    (`where`, [size] bool; None for all), its heads and its `part` were decided before the pass, so
    a compiled graph sees only tensors here, never the step's offset."""

    edit: Edit
    where: Tensor | None
    heads: Selection | None
    part: Tensor | None

    def __call__(self, act: Tensor, hook: Hook) -> Tensor:
        spec = hook.spec
        region = None if self.heads is None else self.heads.region(act, spec)
        if self.where is not None:
            shape = [1] * act.ndim
            shape[1] = act.shape[1]  # (generation edits only points with the [batch, pos, ...] layout)
            positions = self.where.to(act.device).view(shape)
            region = positions if region is None else region & positions
        return self.edit.write(act, spec, region, self.part)


@dataclass(frozen=True)
class Ablate(Edit):
    """Zero or mean ablation of a point's selected region: what `hs.ablate` returns.

    Attributes:
        how: `"zero"` or `"mean"` (the mean over the batch and positions of the input, per feature).
        mean: a precomputed mean to write instead (over a reference dataset, say)."""

    how: str = "zero"  # "zero" | "mean"
    mean: Tensor | None = None  # a precomputed mean (e.g. over a reference dataset)

    def value(self, act: Tensor, spec: PointSpec, part: Tensor | None = None) -> Tensor:
        if self.how == "zero":
            return torch.zeros_like(act)
        if self.how == "mean":
            if self.mean is not None:
                return self.mean.to(act.device)
            # mean over the batch and the positions of this very input, per feature (and per
            # head): the position dim is wherever the point has it ([batch, head, q, k] for
            # attn.pattern averages over queries, not heads)
            dims = (0,) if spec.pos_dim is None else (0, spec.pos_dim % act.ndim)
            return act.mean(dim=dims, keepdim=True)
        raise SelectionError(f"ablate how={self.how!r}: use 'zero' or 'mean'")


@dataclass(frozen=True)
class Patch(Edit):
    """Activations from another run written over a point's selected region: what `hs.patch` returns.

    Attributes:
        source: the activation to write, the shape of the point's activation on this input.

    Raises:
        SelectionError: a source whose shape differs from the activation's (when the model runs)."""

    source: Tensor | None = None

    def value(self, act: Tensor, spec: PointSpec, part: Tensor | None = None) -> Tensor:
        src = self.source if part is None else part
        if src.shape != act.shape:
            raise SelectionError(
                f"patch {self.point}: source has shape {tuple(src.shape)} but the activation is "
                f"{tuple(act.shape)}; capture the source with the same input length and no selection"
            )
        return src.to(act.device)

    def part_at(self, offset: int, size: int, keep: Tensor) -> Tensor:
        """The source at sequence positions [offset, offset + size) (dim 1); positions past its end
        that are not written are filled with zeros."""
        src, have = self.source, self.source.shape[1]
        last = offset + int(keep.nonzero().max())
        if last >= have:
            raise SelectionError(
                f"patch {self.point}: the source covers {have} positions but position "
                f"{last} is to be patched; restrict the patch (positions=, edit_on='prompt')"
                " or give a longer source"
            )
        part = src[:, offset : min(offset + size, have)]
        if part.shape[1] < size:
            filler = src.new_zeros((src.shape[0], size - part.shape[1], *src.shape[2:]))
            part = torch.cat([part, filler], dim=1)
        return part


@dataclass(frozen=True)
class Steer(Edit):
    """A vector added to a point's activation: what `hs.steer` returns.

    Attributes:
        vector: the direction, the size of the point's last dimension.
        scale: how many times it is added."""

    vector: Tensor | None = None
    scale: float = 1.0

    def value(self, act: Tensor, spec: PointSpec, part: Tensor | None = None) -> Tensor:
        vector = self.vector
        if vector.dtype != act.dtype or vector.device != act.device:
            vector = vector.to(act.device, act.dtype)
        return act + (vector if self.scale == 1 else self.scale * vector)  # (x * 1.0 is x: one op fewer)


def ablate(
    point: str,
    how: str = "zero",
    *,
    positions: Positions = None,
    heads: Heads = None,
    mean: Tensor | None = None,
) -> Edit:
    """Zero or mean ablation of a point (or of chosen positions / heads).

    Returns:
        Edit: an edit, to give to `hs.edit` or `hs.generate`.

    Raises:
        SelectionError: `how` other than "zero" / "mean", or positions / heads that do not fit."""
    if how not in ("zero", "mean"):
        raise SelectionError(f"ablate how={how!r}: use 'zero' or 'mean'")
    return Ablate(point, positions, heads, how=how, mean=mean)


def patch(
    point: str, source: Tensor | Mapping[str, Tensor], *, positions: Positions = None, heads: Heads = None
) -> Edit:
    """Write activations from another run (a tensor, or the dict `hs.collect` returns).

    Returns:
        Edit: an edit, to give to `hs.edit` or `hs.generate`.

    Raises:
        SelectionError: a dict without `point`; a source whose shape differs from the activation."""
    if isinstance(source, Mapping):
        key = point if point in source else find_key(source, point)  # (hs.collect's dict knows its aliases)
        if key is None:
            raise SelectionError(f"patch {point}: the source has no such point; it has {list(source)}")
        source = source[key]
    return Patch(point, positions, heads, source=source)


def steer(point: str, vector: Tensor, *, scale: float = 1.0, positions: Positions = None) -> Edit:
    """Add `scale * vector` to a point (a steering vector on the residual stream, say).

    Returns:
        Edit: an edit, to give to `hs.edit` or `hs.generate`.

    Raises:
        SelectionError: positions that do not fit the point."""
    return Steer(point, positions, None, vector=vector, scale=scale)


class Edits(Hooks):
    """Hooks that apply edits while the `with` block runs. An edit at positions="last" writes
    each row's last real token when the model is called with `attention_mask=`.

    Built by `hs.edit(model, *edits)`; a `Hooks` set, removed when the block exits.

    Raises:
        UnknownPointError: an edit on a point the model does not have (when it is built)."""

    def __init__(self, model: nn.Module, edits: tuple[Edit, ...]):
        super().__init__(model, arch_of(model))
        self.edits = edits
        self._specs: list[PointSpec] = [self.arch.spec(e.point) for e in edits]  # validate names now
        for spec in self._specs:
            spec.require_writable("an edit")
        self._mask: Tensor | None = None

    def __enter__(self) -> Edits:
        try:
            for spec, e in zip(self._specs, self.edits, strict=True):
                if e.selection.wants_attention_mask:
                    self.forward(spec, lambda act, hook, e=e: e(act, hook, attention_mask=self._mask))
                else:
                    self.forward(spec, e)
            if any(e.selection.wants_attention_mask for e in self.edits):
                self.pass_start(self._start_pass)
        except BaseException:
            self.remove()
            raise
        return self

    def _start_pass(self, mask: Tensor | None) -> None:
        self._mask = mask


def edit(model: nn.Module, *edits: Edit) -> Edits:
    """Apply edits for the length of a `with` block.

    Edits write new tensors (never in place); a `hs.capture` opened inside sees the edited values.

    Returns:
        Edits: a `with` block; the edits apply to every forward pass inside it.

    Raises:
        UnknownPointError: an edit on a point the model does not have.
        HookscopeError: an edit on a point the model never reads back (a Hugging Face attention pattern)."""
    return Edits(model, edits)
