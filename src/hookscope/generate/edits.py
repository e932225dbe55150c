"""Edits across generation steps: the core's `Edit`, asked before each pass what it writes there
(`Edit.step`), within the part of the sequence `edit_on` allows.

Per generated token an edit should cost what a hand-written hook costs: its data is moved to the
point's device before generating and cast to the activation's dtype on the first pass, once (a
steering vector made on the CPU in float32 would otherwise be copied to the GPU, the host waiting
for it, and cast, at every step), and an edit whose decision is the same on every pass (a steer or
ablation of every position, `edit_on="both"`) makes it once, so nothing runs for it before a pass.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from ..arch import Arch, PointSpec
from ..edit import Ablate, Edit, EditStep, Patch, Steer
from ..errors import HookscopeError, SelectionError
from ..hooks import Hook

EDIT_ON = ("prompt", "generated", "both")
# the tensor each built-in edit writes from (its `value` moves it to the activation's device and dtype)
_DATA = ((Steer, "vector"), (Ablate, "mean"), (Patch, "source"))


class StepEdit:
    """One edit while a model generates. `prepare` (eager, before each pass) takes the edit's
    decision for the pass's positions; the hook (traced into a compiled block under `blocks`)
    runs that decision, so one graph per kind of decision serves every step. `fixed`: the decision
    is the same on every pass, taken here once (no `prepare` needed)."""

    def __init__(self, edit: Edit, spec: PointSpec, edit_on: str, prompt_length: int):
        self.edit, self.spec, self.edit_on, self.prompt_length = edit, spec, edit_on, prompt_length
        self.current: EditStep | None = None
        self.dtype: torch.dtype | None = None  # the dtype the edit's data was cast to (on the first pass)
        self.fixed = (
            edit_on == "both" and edit.selection.positions is None and type(edit).part_at is Edit.part_at
        )
        if self.fixed:
            self.current = edit.step(0, 1)

    @classmethod
    def checked(
        cls, edit: object, arch: Arch, model: nn.Module, edit_on: str, prompt_length: int
    ) -> StepEdit:
        """A step edit, once `edit` is known to follow sequence positions (refused before generating),
        its data on the device of the point's module."""
        spec = check(edit, arch)
        weight = _weight(arch.module(model, spec), model)
        if weight is not None and weight.device.type != "meta":
            edit = _placed(edit, weight.device, None)
        return cls(edit, spec, edit_on, prompt_length)

    def prepare(self, lo: int, hi: int) -> None:
        """Decide what the edit writes on a pass over sequence positions [lo, hi)."""
        allowed: Tensor | None = None
        if self.edit_on != "both":
            span = (0, self.prompt_length) if self.edit_on == "prompt" else (self.prompt_length, hi)
            if hi <= span[0] or lo >= span[1]:  # the pass is all outside what edit_on allows
                self.current = None
                return
            if lo < span[0] or hi > span[1]:  # (only a pass over prompt and generated tokens at once)
                allowed = torch.tensor([span[0] <= q < span[1] for q in range(lo, hi)])
        self.current = self.edit.step(lo, hi - lo, allowed)

    def __call__(self, act: Tensor, hook: Hook) -> Tensor | None:
        step = self.current
        if step is None:
            return None
        if act.dtype is not self.dtype and not torch.compiler.is_compiling():  # (a graph casts in place)
            step = self._cast(act, step)
        return step(act, hook)

    def _cast(self, act: Tensor, step: EditStep) -> EditStep:
        """The edit, and this pass's step, with its data in the activation's dtype from now on."""
        self.dtype, self.edit = act.dtype, _placed(self.edit, act.device, act.dtype)
        self.current = dataclasses.replace(step, edit=self.edit)
        return self.current


def check(edit: object, arch: Arch) -> PointSpec:
    """The point `edit` writes, once the edit is known to follow sequence positions (else an error
    naming the fix): what every generation checks before it starts, with or without the model."""
    if not isinstance(edit, Edit):
        raise HookscopeError(
            f"edits= takes hs.steer / hs.ablate / hs.patch values, got {type(edit).__name__}"
        )
    spec = arch.spec(edit.point)
    spec.require_writable("an edit")
    if spec.pos_dim != 1:
        raise SelectionError(
            f"edit on {spec.name}: the point has no [batch, pos, ...] layout to follow "
            "during generation; use a canonical point name (hs.points(model))"
        )
    edit.selection.from_start(f"edit on {spec.name} (or use edit_on='prompt' / 'generated')")
    return spec


def _weight(module: nn.Module, model: nn.Module) -> Tensor | None:
    """A parameter of the point's module (else of the model): on the device the point computes on."""
    for owner in (module, model):
        weight = next(owner.parameters(), None)
        if weight is not None:
            return weight
    return None


def _placed(edit: Edit, device: torch.device, dtype: torch.dtype | None) -> Edit:
    """`edit` with its data on `device` (floating data in `dtype`, unless None): the move and cast its
    `value` makes at every step, made once (the same values). Other kinds of edit are left as they are."""
    for kind, name in _DATA:
        data = getattr(edit, name, None) if isinstance(edit, kind) else None
        if isinstance(data, Tensor):
            moved = data.to(device, dtype if dtype is not None and data.is_floating_point() else None)
            return edit if moved is data else dataclasses.replace(edit, **{name: moved})
    return edit
