"""Edits across generation steps: the core's `Edit`, asked before each pass what it writes there
(`Edit.step`), within the part of the sequence `edit_on` allows."""

from __future__ import annotations

import torch
from torch import Tensor

from ..arch import PointSpec
from ..edit import Edit, EditStep
from ..errors import HookscopeError, SelectionError
from ..hooks import Hook

EDIT_ON = ("prompt", "generated", "both")


class StepEdit:
    """One edit while a model generates. `prepare` (eager, before each pass) takes the edit's
    decision for the pass's positions; the hook (traced into a compiled block under `blocks`)
    runs that decision, so one graph per kind of decision serves every step."""

    def __init__(self, edit: Edit, spec: PointSpec, edit_on: str, prompt_length: int):
        self.edit, self.spec, self.edit_on, self.prompt_length = edit, spec, edit_on, prompt_length
        self.current: EditStep | None = None

    @classmethod
    def checked(cls, edit: object, spec_of, edit_on: str, prompt_length: int) -> StepEdit:
        """A step edit, once `edit` is known to follow sequence positions (refused before generating)."""
        if not isinstance(edit, Edit):
            raise HookscopeError("edits= takes hs.steer / hs.ablate / hs.patch values, got "
                                 f"{type(edit).__name__}")
        spec = spec_of(edit.point)
        if spec.pos_dim != 1:
            raise SelectionError(f"edit on {spec.name}: the point has no [batch, pos, ...] layout to follow "
                                 "during generation; use a canonical point name (hs.points(model))")
        edit.selection.from_start(f"edit on {spec.name} (or use edit_on='prompt' / 'generated')")
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
        return None if step is None else step(act, hook)
