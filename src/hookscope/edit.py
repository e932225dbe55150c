"""Interventions by point name: ablate, patch, steer. Each is a small value object; `hs.edit`
attaches any number of them for the length of a `with` block, and composes with `hs.capture`:

    clean = hs.collect(model, clean_ids, "blocks.4.attn.z")
    with hs.edit(model, hs.patch("blocks.4.attn.z", clean, heads=[2]),
                 hs.steer("blocks.6.resid_post", vector, scale=4.0)):
        logits = model(corrupt_ids)

Edits write new tensors (never in place), so they are safe under autograd and the model's own
activations are left untouched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .arch import PointSpec, arch_of
from .arch.base import ROOT
from .errors import SelectionError
from .hooks import Hook, Hooks
from .inputs import attention_mask_of
from .names import find_key
from .selection import Heads, Positions, Selection


@dataclass(frozen=True)
class Edit:
    """Replace the selected region of a point's activation with `value(act, spec)`. An edit is a
    hook function, `edit(act, hook) -> new act`, usable with `Hooks.forward` as it is."""

    point: str
    positions: Positions = None
    heads: Heads = None
    selection: Selection = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "selection", Selection.of(self.positions, self.heads))

    def value(self, act: Tensor, spec: PointSpec) -> Tensor:  # what the selected region becomes
        raise NotImplementedError

    def __call__(self, act: Tensor, hook: Hook, *, attention_mask: Tensor | None = None) -> Tensor:
        spec = hook.spec
        new = self.value(act, spec).to(act.dtype)
        if self.positions is None and self.heads is None:
            return new.expand_as(act) if new.shape != act.shape else new
        return torch.where(self.selection.region(act, spec, attention_mask=attention_mask), new, act)


@dataclass(frozen=True)
class Ablate(Edit):
    how: str = "zero"  # "zero" | "mean"
    mean: Tensor | None = None  # a precomputed mean (e.g. over a reference dataset)

    def value(self, act: Tensor, spec: PointSpec) -> Tensor:
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
    source: Tensor | None = None

    def value(self, act: Tensor, spec: PointSpec) -> Tensor:
        src = self.source
        if src.shape != act.shape:
            raise SelectionError(
                f"patch {self.point}: source has shape {tuple(src.shape)} but the activation is "
                f"{tuple(act.shape)}; capture the source with the same input length and no selection"
            )
        return src.to(act.device)


@dataclass(frozen=True)
class Steer(Edit):
    vector: Tensor | None = None
    scale: float = 1.0

    def value(self, act: Tensor, spec: PointSpec) -> Tensor:
        return act + self.scale * self.vector.to(act.device, act.dtype)


def ablate(point: str, how: str = "zero", *, positions: Positions = None, heads: Heads = None,
           mean: Tensor | None = None) -> Ablate:
    """Zero or mean ablation of a point (or of chosen positions / heads)."""
    if how not in ("zero", "mean"):
        raise SelectionError(f"ablate how={how!r}: use 'zero' or 'mean'")
    return Ablate(point, positions, heads, how=how, mean=mean)


def patch(point: str, source: Tensor | Mapping[str, Tensor], *, positions: Positions = None,
          heads: Heads = None) -> Patch:
    """Write activations from another run (a tensor, or the dict `hs.collect` returns)."""
    if isinstance(source, Mapping):
        key = find_key(source, point)
        if key is None:
            raise SelectionError(f"patch {point}: the source has no such point; it has {list(source)}")
        source = source[key]
    return Patch(point, positions, heads, source=source)


def steer(point: str, vector: Tensor, *, scale: float = 1.0, positions: Positions = None) -> Steer:
    """Add `scale * vector` to a point (a steering vector on the residual stream, say)."""
    return Steer(point, positions, None, vector=vector, scale=scale)


class Edits(Hooks):
    """Hooks that apply edits while the `with` block runs. An edit at positions="last" writes
    each row's last real token when the model is called with `attention_mask=`."""

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
                self.module_pre_forward(ROOT, self._start_pass)
        except BaseException:
            self.remove()
            raise
        return self

    def _start_pass(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._mask = attention_mask_of(kwargs)


def edit(model: nn.Module, *edits: Edit) -> Edits:
    """Apply edits for the length of a `with` block."""
    return Edits(model, edits)
