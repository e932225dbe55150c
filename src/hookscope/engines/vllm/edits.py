"""Edits (`hs.steer`, `hs.ablate`, `hs.patch`) on a vLLM engine, per request.

The caller describes each `Edit` as plain data (`describe`: its kind's name and its dataclass
fields, tensors as lists of numbers) and the workers rebuild the same `Edit` from it (`rebuild`):
nothing executable crosses processes. In the worker, `RequestEdits` applies a request's edits with
the generation code's own `StepEdit` (the edit asked, before each forward, what it writes on the
positions this forward holds of the request: `Edit.step`), to that request's token rows only, as a
`[1, tokens, ...]` batch of one: what Hugging Face's `hs.generate` runs for that request alone.
A capture's `Selection` crosses the same way (`describe_selection`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

import torch
from torch import Tensor, nn

from ...arch.base import ROOT, Arch
from ...edit import Ablate, Edit, Patch, Steer
from ...errors import EngineError
from ...generate.edits import StepEdit, check
from ...hooks import Hook, Hooks
from ...selection import Selection
from . import tables
from .batch import InPass, requests_in_pass

KINDS = {kind.__name__: kind for kind in (Steer, Ablate, Patch)}  # what a worker rebuilds, by name


def _plain(value: Any) -> Any:
    if isinstance(value, Tensor):
        t = value.detach().to("cpu")
        return {
            "tensor": t.flatten().tolist(),
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
        }
    if isinstance(value, slice):
        return {"slice": [value.start, value.stop, value.step]}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _value(plain: Any) -> Any:
    if isinstance(plain, dict) and "tensor" in plain:
        return torch.tensor(plain["tensor"], dtype=getattr(torch, plain["dtype"])).reshape(plain["shape"])
    if isinstance(plain, dict) and "slice" in plain:
        return slice(*plain["slice"])
    if isinstance(plain, list):
        return [_value(v) for v in plain]
    return plain


def describe(edit: Any, arch: Arch) -> dict:
    """`edit` as plain data for the workers, once it is known to apply there (else an error naming
    the fix, before any work). A patch's source is the request's own: `[n_tokens, ...]`, as
    `hs.collect` on the engine returns it."""
    spec = check(edit, arch)
    kind = type(edit).__name__
    if KINDS.get(kind) is not type(edit):
        raise EngineError(
            f"{kind} edits do not run on a vLLM engine: edits= there takes hs.steer, hs.ablate and hs.patch"
        )
    check_writable(spec)
    if isinstance(edit, Steer):
        check_width(arch, spec.name, edit.vector.numel())
    if isinstance(edit, Patch):
        _check_covers(edit)
    if isinstance(edit, Ablate) and edit.how == "mean" and edit.mean is None:
        raise EngineError(
            f"ablate {spec.name} how='mean' takes the mean over the forward's own tokens, and vLLM runs a "
            "prompt in chunks shared with other requests: give the mean to write (mean=, e.g. over a "
            "reference set from hs.collect)"
        )
    fields = {f.name: getattr(edit, f.name) for f in dataclasses.fields(edit) if f.init}
    if isinstance(edit, Patch):
        fields["source"] = edit.source.unsqueeze(0)  # the batch of one the worker edits
    fields["point"] = spec.name
    return {"kind": kind, "fields": {name: _plain(v) for name, v in fields.items()}}


def check_writable(spec) -> None:
    """A point vLLM's table marks read-only is refused, saying why, before any worker is called."""
    why = tables.read_only(spec)
    if why:
        raise EngineError(f"{spec.name} cannot be written on vLLM: {why}")


def check_width(arch: Arch, point: str, n: int) -> None:
    """A residual-stream vector must be d_model wide (a wrong one would fail inside the engine's forward)."""
    if arch.d_model and "resid" in point and n != arch.d_model:
        raise EngineError(f"a vector of {n} values for {point}: it is d_model = {arch.d_model} wide")


def _check_covers(patch: Patch) -> None:
    """The positions a patch names lie within its source (`[n_tokens, ...]`), checked before the engine
    runs: a patch past its source's end would fail inside the engine's forward."""
    p = patch.selection.positions
    if isinstance(p, slice):
        named = [] if p.stop is None else [p.stop - 1]
    else:
        named = [] if p is None else torch.as_tensor(p).flatten().tolist()
    have = patch.source.shape[0]
    if named and max(named) >= have:
        raise EngineError(
            f"patch {patch.point}: its source holds {have} tokens ([n_tokens, ...], a request's own rows) "
            f"but position {max(named)} is to be patched: give a longer source or fewer positions"
        )


def rebuild(plain: dict) -> Edit:
    """The `Edit` a `describe` described."""
    return KINDS[plain["kind"]](**{name: _value(v) for name, v in plain["fields"].items()})


def describe_selection(selection: Selection) -> dict | None:
    """What a capture keeps (`Selection.of`'s positions, heads and dtype) as plain data for the
    workers; None for everything."""
    if selection.positions is None and selection.heads is None and selection.dtype is None:
        return None
    dtype = None if selection.dtype is None else str(selection.dtype).removeprefix("torch.")
    return {"positions": _plain(selection.positions), "heads": _plain(selection.heads), "dtype": dtype}


def rebuild_selection(plain: dict | None) -> Selection:
    """The `Selection` a `describe_selection` described."""
    if plain is None:
        return Selection.of()
    dtype = None if plain["dtype"] is None else getattr(torch, plain["dtype"])
    return Selection.of(positions=_value(plain["positions"]), heads=_value(plain["heads"]), dtype=dtype)


class RequestEdits:
    """One call's edits in one worker: request index -> its edits (described), each rebuilt as a
    `StepEdit` the first time a forward holds the request, and applied on every forward that does."""

    def __init__(
        self,
        runner,
        model: nn.Module,
        arch: Arch,
        hooks: Hooks,
        run: str,
        edits: dict,
        edit_on: str,
        split: Collection[str] = (),
    ):
        self.runner, self.model, self.arch, self.run, self.edit_on = runner, model, arch, run, edit_on
        self.described = {int(index): [rebuild(e) for e in described] for index, described in edits.items()}
        on_slices = sorted(
            {arch.spec(e.point).name for one in self.described.values() for e in one} & set(split)
        )
        if on_slices:  # before any hook: a tensor-parallel rank holds a slice of these, the edit the whole
            raise EngineError(
                f"edits at {', '.join(on_slices)} on a tensor-parallel engine, whose ranks each hold a slice "
                "of them: edit a point every rank holds whole (resid_*, attn.out, mlp.out) or use "
                "tensor_parallel_size=1"
            )
        self.built: dict[int, dict[str, list[StepEdit]]] = {}  # request index -> point -> its step edits
        self.now: list[tuple[InPass, dict[str, list[StepEdit]]]] = []  # this forward's edited requests
        hooks.module_pre_forward(ROOT, self._pass_start)
        for name in dict.fromkeys(e.point for edits in self.described.values() for e in edits):
            hooks.forward(arch.spec(name), self._edit)

    def _built(self, index: int, req: InPass) -> dict[str, list[StepEdit]]:
        if index not in self.built:
            # the prompt's length as the caller counts it (a follow-up pass over prompt + generated
            # tokens says so), for edit_on
            prompt = req.tag.get("prompt_length") or len(req.state.prompt_token_ids or ())
            per_point: dict[str, list[StepEdit]] = {}
            for edit in self.described[index]:
                step_edit = StepEdit.checked(edit, self.arch, self.model, self.edit_on, prompt)
                per_point.setdefault(step_edit.spec.name, []).append(step_edit)
            self.built[index] = per_point
        return self.built[index]

    def _pass_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.now = []
        for req in requests_in_pass(self.runner):
            index = req.tag.get("index")
            if req.tag.get("run") != self.run or index not in self.described:
                continue
            per_point = self._built(index, req)
            for step_edits in per_point.values():
                for step_edit in step_edits:
                    step_edit.prepare(req.offset, req.offset + req.end - req.start)
            self.now.append((req, per_point))

    def _edit(self, act: Tensor, hook: Hook) -> Tensor | None:
        out = None
        for req, per_point in self.now:
            for step_edit in per_point.get(hook.spec.name, ()):
                out = act.clone() if out is None else out
                new = step_edit(out[req.start : req.end].unsqueeze(0), hook)
                if new is not None:
                    out[req.start : req.end] = new[0]
        return out
