"""Edits (`hs.steer`, `hs.ablate`, `hs.patch`) on a vLLM engine, per request.

The caller describes each `Edit` as plain data (`describe`: its kind's name and its dataclass
fields, tensors as lists of numbers) and the workers rebuild the same `Edit` from it (`rebuild`):
nothing executable crosses processes. In the worker, `RequestEdits` applies a request's edits (those
of the open `hs.edit` blocks, the named ones it asks for and those its call gave) with
the generation code's own `StepEdit` (the edit asked, before each forward, what it writes on the
positions this forward holds of the request: `Edit.step`), to that request's token rows only, as a
`[1, tokens, ...]` batch of one: what Hugging Face's `hs.generate` runs for that request alone.
On a tensor-parallel engine an edit at a point each rank holds a slice of is given for the whole
point and each rank writes its part (`sharded.edit_on_rank`).
An edit that raises there (a value of the wrong shape that only shows against the activation) is
caught on that path: an error out of a forward would stop the engine, or leave its scheduler unable
to run another request. The request runs on without its edits and the fault is kept (`Fault`) for
the call or `hs.edit` block that gave the edit to raise on the caller.
A capture's `Selection` crosses the same way (`describe_selection`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ...arch.base import Arch
from ...edit import Ablate, Edit, Patch, Steer
from ...errors import EngineError
from ...generate.edits import StepEdit, check
from ...hooks import Hook, Hooks
from ...selection import Selection
from . import sharded, tables
from .batch import InPass, PerRequest, Rows

KINDS = {kind.__name__: kind for kind in (Steer, Ablate, Patch)}  # what a worker rebuilds, by name
DATA = {Steer: "vector", Ablate: "mean", Patch: "source"}  # each kind's tensor, named in a fault
# the points whose activation is d_model wide per token, which an edit's tensor is checked against
D_MODEL_WIDE = ("resid_pre", "resid_mid", "resid_post", "attn.out", "mlp.in", "mlp.out")

log = logging.getLogger("hookscope")


class _Group(NamedTuple):
    """Step edits a forward applies in turn at one point: the rows they write and the requests those
    rows are of (told of a fault)."""

    step_edits: list[StepEdit]
    rows: Rows
    requests: list[InPass]


class Fault(NamedTuple):
    """An edit that raised in a worker's forward: the request it was applied to (`run`, `index`: its
    call's tag, None for a request no hookscope call tagged), the point and what went wrong."""

    run: str | None
    index: int | None
    point: str
    message: str


def fault_message(faults: list[Fault]) -> str:
    """What the caller is told of a call's or block's faults: the first, and how many more."""
    more = f" (and {len(faults) - 1} more such faults)" if len(faults) > 1 else ""
    return faults[0].message + more


def _edit_named(edit: Any) -> str:
    """An edit as the caller wrote it: its kind, point, and its tensor's shape and dtype."""
    if not isinstance(edit, Edit):
        return repr(edit)
    name = DATA.get(type(edit))
    data = getattr(edit, name, None) if name else None
    held = f", {name} of shape {list(data.shape)} {data.dtype}" if isinstance(data, Tensor) else ""
    return f"hs.{type(edit).__name__.lower()}({edit.point!r}{held})"


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
    if isinstance(edit, Edit):
        tables.refuse_unexposed(arch, edit.point, "written")
    spec = check(edit, arch)
    kind = type(edit).__name__
    if KINDS.get(kind) is not type(edit):
        raise EngineError(
            f"{kind} edits do not run on a vLLM engine: edits= there takes hs.steer, hs.ablate and hs.patch"
        )
    check_writable(spec)
    check_width(arch, spec.name, edit)
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


def check_width(arch: Arch, point: str, edit: Edit) -> None:
    """An edit's tensor at a point d_model wide (`D_MODEL_WIDE`) must fit it: a steering vector or
    an ablation's mean of d_model values, a patch's source d_model wide per token. One that does not
    would only fail inside the engine's forward (where the workers catch it, edits.py's top)."""
    name = DATA.get(type(edit))
    data = getattr(edit, name, None) if name else None
    if not arch.d_model or not isinstance(data, Tensor) or not point.endswith(D_MODEL_WIDE):
        return
    width = data.shape[-1] if isinstance(edit, Patch) and data.ndim else data.numel()
    if width != arch.d_model:
        what = "per token" if isinstance(edit, Patch) else "in all"
        raise EngineError(
            f"{_edit_named(edit)}: its {name} holds {width} values {what} for {point}, which is "
            f"d_model = {arch.d_model} wide: give it {arch.d_model}"
        )


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


def check_for_every_request(edit: Edit) -> None:
    """An edit for every request the engine runs (an `hs.edit` block), whose prompts are not known
    yet: a patch must name the positions it writes (each within its source), or a longer request
    would reach past its source's end inside the engine's forward."""
    if not isinstance(edit, Patch):
        return
    p = edit.selection.positions
    if p is None or (isinstance(p, slice) and p.stop is None):
        raise EngineError(
            f"patch {edit.point} in hs.edit applies to every request the engine runs, of any length, and "
            f"its source holds {edit.source.shape[0]} tokens: name the positions it writes (positions=[...] "
            "or a slice with an end, within the source), or give the patch to one call's edits="
        )


def rebuild(plain: dict) -> Edit:
    """The `Edit` a `describe` described."""
    return KINDS[plain["kind"]](**{name: _value(v) for name, v in plain["fields"].items()})


def on_the_wire(edits: dict[int, list[dict]]) -> dict:
    """A call's edits (request index -> described edits) as sent to its workers: each distinct edit
    once and each request's as indices into them, so that a vector given to every request is
    serialized, sent and rebuilt once. `describe_edits` hands one dict per edit given, shared by the
    requests it applies to: that dict is what is sent once. Empty for no edits."""
    if not edits:
        return {}
    distinct: list[dict] = []
    index_of: dict[int, int] = {}  # id(described) -> its index in distinct
    requests: dict[str, list[int]] = {}
    for i, described in edits.items():
        for one in described:
            if id(one) not in index_of:
                index_of[id(one)] = len(distinct)
                distinct.append(one)
        requests[str(i)] = [index_of[id(one)] for one in described]
    return {"edits": distinct, "requests": requests}


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
    """The one edit path of a worker: each request's edits, applied by the generation code's
    `StepEdit` on that request's token rows only. A request's edits are those of the open `hs.edit`
    blocks (`open_block`: on every request, tagged or not, in the order the blocks opened), then
    those its tag asks for: the named edits (registered at start, `name`: a steering vector at a
    scale, an ablation) and the edits its call gave (`add_run`: request index -> edits, with the
    call's `edit_on`). They are built once per request (`PerRequest`) and prepared on every forward
    that holds it. `split`: the points each tensor-parallel rank holds a slice of -> the dim they are
    gathered along, which an edit there is cut along."""

    def __init__(self, model: nn.Module, arch: Arch, split: Mapping[str, int] | None = None):
        self.model, self.arch, self.split = model, arch, dict(split or {})
        # an edit at a split point as this rank writes it (None: nothing here): id(edit) -> (edit, that)
        self.on_rank: dict[int, tuple[Edit, Edit | None]] = {}
        self.named: dict[str, Edit] = {}
        self.runs: dict[str, tuple[dict[int, list[Edit]], str]] = {}  # run -> (index -> edits, edit_on)
        self.blocks: dict[str, list[Edit]] = {}  # open hs.edit blocks, in the order they opened -> edits
        self.scaled: dict[tuple[str, float], Edit] = {}  # a named vector at a scale, one for every request
        # an edit that writes the same on every pass and position (`StepEdit.fixed`): one step edit for
        # every request that has it, applied to all their rows at once. id(edit) -> (edit, step edit)
        self.shared: dict[int, tuple[Edit, StepEdit]] = {}
        self.built = PerRequest()  # request id -> point -> its step edits
        self.points: dict[str, tuple[Hooks, set[str]]] = {}  # point -> (its one hook, who needs it)
        # this forward: point -> its groups of step edits
        self.now: dict[str, list[_Group]] = {}
        self.faults: list[Fault] = []  # edits that raised, until their call or block reports them
        # whether `now` holds for a forward of the same requests at the same rows as the last one (a
        # decode step's usual case): no edit of theirs follows positions, nothing registered since
        self.now_holds = False

    def active(self) -> bool:
        return bool(self.named or self.runs or self.blocks)

    def every_request(self) -> bool:
        """Whether some edits apply to every request, whether hookscope tagged it or not (an open
        `hs.edit` block)."""
        return bool(self.blocks)

    def open_block(self, block: str, edits: list[dict]) -> None:
        """An `hs.edit` block's edits (described), on every token of every request from now until
        `close_block`, after those of the blocks opened before it."""
        rebuilt = [rebuild(described) for described in edits]
        self._cut(rebuilt)
        self.blocks[block] = rebuilt
        self.built = PerRequest()  # a live request's edits are built anew, with the block's
        for edit in rebuilt:
            self._attach(edit.point, block)

    def close_block(self, block: str) -> None:
        self._release(block, self.blocks.pop(block, []))
        self.built = PerRequest()
        if not self.blocks:  # faults no block reports now (a named edit's, logged when it raised)
            self.faults = [f for f in self.faults if f.run is not None]

    def name(self, name: str, described: dict) -> None:
        """Register a named edit (a `describe`d Steer or Ablate) that requests ask for by name."""
        edit = rebuild(described)
        self._cut([edit])
        self.named[name] = edit
        self.scaled = {key: e for key, e in self.scaled.items() if key[0] != name}  # (registered anew)
        self._attach(edit.point, "")

    def add_run(self, run: str, edits: dict, edit_on: str) -> None:
        """The edits of one call (`on_the_wire`: each distinct edit once, each request's as indices),
        before its requests run."""
        distinct = [rebuild(described) for described in edits["edits"]]  # shared by the requests given it
        rebuilt = {int(index): [distinct[k] for k in ks] for index, ks in edits["requests"].items()}
        self._cut(distinct)
        self.runs[run] = (rebuilt, edit_on)
        for edit in distinct:
            self._attach(edit.point, run)

    def drop_run(self, run: str) -> None:
        self.faults_of_run(run)  # (a call that ended without taking its rows: no one to tell)
        edits, _ = self.runs.pop(run, ({}, ""))
        self._release(run, [e for one in edits.values() for e in one])

    def _release(self, owner: str, edits: list[Edit]) -> None:
        """`owner`'s edits forgotten, and the hooks at the points no one else edits removed."""
        self.now_holds = False  # a forward's decisions are made anew without them
        gone = {id(e) for e in edits}
        self.shared = {key: kept for key, kept in self.shared.items() if key not in gone}
        self.on_rank = {key: cut for key, cut in self.on_rank.items() if key not in gone}
        for point, (hooks, owners) in list(self.points.items()):
            owners.discard(owner)
            if not owners:
                hooks.remove()
                del self.points[point]

    def _cut(self, edits: list[Edit]) -> None:
        """Each edit at a split point cut to this rank's slice now, before any hook: a value that does
        not fit the whole point is refused here."""
        for edit in edits:
            self._here(edit)

    def _here(self, edit: Edit) -> Edit | None:
        """`edit` as this rank writes it: as it is at a point every rank holds whole, else its part of
        the rank's slice (None where it writes nothing on this rank), cut once per edit."""
        spec = self.arch.spec(edit.point)
        if spec.name not in self.split:
            return edit
        kept = self.on_rank.get(id(edit))
        if kept is None or kept[0] is not edit:
            kept = (edit, sharded.edit_on_rank(edit, self.model, spec, self.split[spec.name]))
            self.on_rank[id(edit)] = kept
        return kept[1]

    def _attach(self, point: str, owner: str) -> None:
        """One hook per point, whoever needs it (`owner`: a run, a block, or "" for the named edits)."""
        self.now_holds = False  # a forward's decisions are made anew with these edits
        spec = self.arch.spec(point)
        if spec.name not in self.points:
            hooks = Hooks(self.model, self.arch)
            hooks.forward(spec, self._edit)
            self.points[spec.name] = (hooks, set())
        self.points[spec.name][1].add(owner)

    def _asked(self, req: InPass) -> list[tuple[Edit, str]]:
        """The edits of the open blocks and those a request's tag asks for, each with the part of the
        sequence it edits, in the order they apply (Hugging Face's: a block's hooks were attached
        before those of a call made inside it)."""
        asked = [(edit, "both") for edits in self.blocks.values() for edit in edits]
        for name, scale in req.tag.get("steer", ()):
            if (name, float(scale)) not in self.scaled:
                edit = self._named(name, Steer, "steering vector")
                self.scaled[(name, float(scale))] = dataclasses.replace(edit, scale=edit.scale * float(scale))
            asked.append((self.scaled[(name, float(scale))], "both"))
        for name, on in req.tag.get("ablate", ()):
            if on:
                asked.append((self._named(name, Ablate, "ablation"), "both"))
        run = self.runs.get(req.tag.get("run"))
        if run is not None:
            edits, edit_on = run
            asked += [(edit, edit_on) for edit in edits.get(req.tag.get("index"), ())]
        return asked

    def _named(self, name: str, kind: type, what: str) -> Edit:
        edit = self.named.get(name)
        if not isinstance(edit, kind):
            known = sorted(n for n, e in self.named.items() if isinstance(e, kind))
            raise EngineError(
                f"a request asks for {what} {name!r}, which this engine has not registered "
                f"(it has: {', '.join(known) or 'none'})"
            )
        return edit

    def _build(self, req: InPass) -> dict[str, list[StepEdit]]:
        # the prompt's length as the caller counts it (a follow-up pass over prompt + generated tokens
        # says so), for edit_on
        prompt = req.tag.get("prompt_length") or len(req.state.prompt_token_ids or ())
        per_point: dict[str, list[StepEdit]] = {}
        for edit, edit_on in self._asked(req):
            here = self._here(edit)
            if here is None:  # (heads that other tensor-parallel ranks hold)
                continue
            kept = self.shared.get(id(edit))
            if kept is not None and kept[0] is edit and edit_on == "both":
                step_edit = kept[1]
            else:
                step_edit = StepEdit.checked(here, self.arch, self.model, edit_on, prompt)
                if step_edit.fixed:
                    self.shared[id(edit)] = (edit, step_edit)
            per_point.setdefault(step_edit.spec.name, []).append(step_edit)
        return per_point

    def pass_start(self, requests: list[InPass], live: Collection[str], same_rows: bool = False) -> None:
        """Before a forward: each of its requests' step edits decided for the positions it holds, and
        the requests whose one edit at a point is a shared fixed one gathered to be edited at once.
        `same_rows`: the forward holds the same requests at the same rows as the one before."""
        self.built.forget_finished(live)
        if same_rows and self.now_holds:
            return
        follows_positions = False
        alone: dict[str, list[_Group]] = {}
        together: dict[str, dict[StepEdit, list[InPass]]] = {}
        for req in requests:
            for point, step_edits in self._prepared(req).items():
                if len(step_edits) == 1 and step_edits[0].fixed:
                    together.setdefault(point, {}).setdefault(step_edits[0], []).append(req)
                    continue
                follows_positions = follows_positions or not all(e.fixed for e in step_edits)
                alone.setdefault(point, []).append(_Group(step_edits, Rows([(req.start, req.end)]), [req]))
        for point, groups in together.items():
            alone.setdefault(point, []).extend(
                _Group([step_edit], Rows([(r.start, r.end) for r in reqs]), reqs)
                for step_edit, reqs in groups.items()
            )
        self.now = alone
        self.now_holds = not follows_positions

    def _prepared(self, req: InPass) -> dict[str, list[StepEdit]]:
        """A request's step edits per point, decided for the positions this forward holds of it
        (none, once one of its edits raised: the request runs on without them)."""
        step_edit = None
        try:
            per_point = self.built.get(req.req_id, req.state, self._build, req)
            for step_edits in per_point.values():
                for step_edit in step_edits:
                    if not step_edit.fixed:
                        step_edit.prepare(req.offset, req.offset + req.end - req.start)
        except Exception as error:  # a request's edit that cannot be built or follow its positions
            self._fail([req], None if step_edit is None else step_edit.edit, "", error)
            return {}
        return per_point

    def _edit(self, act: Tensor, hook: Hook) -> Tensor | None:
        edits = self.now.get(hook.spec.name)
        if not edits:
            return None
        if len(edits) == 1 and edits[0].rows.covers(act.shape[0]):  # one edit on every row: no copy first
            return self._apply(edits[0], act, hook)
        out = act.clone()
        for group in edits:
            group.rows.put(out, self._apply(group, group.rows.take(out), hook))
        return out

    def _apply(self, group: _Group, rows: Tensor, hook: Hook) -> Tensor:
        """`rows` ([tokens, ...]) with the group's step edits applied in turn, as a batch of one; as
        they came, where one of them raises (a fault of the group's requests)."""
        batch = rows.unsqueeze(0)
        for step_edit in group.step_edits:
            try:
                new = step_edit(batch, hook)
            except Exception as error:  # the forward runs on: an error out of it would stop the engine
                self._fail(group.requests, step_edit.edit, hook.spec.name, error)
                return rows
            batch = batch if new is None else new
        return batch[0]

    def _fail(self, requests: list[InPass], edit: Edit | None, point: str, error: Exception) -> None:
        """`error`, raised by `edit` on `requests`: they run on without their edits, and the fault is
        kept for their call or block to report (only logged where none will: a request asking for a
        named edit under `vllm serve`)."""
        self.now_holds = False  # the next forward's edits are decided anew, without theirs
        at = f" at {point}" if point else ""
        for req in requests:
            self.built.put(req.req_id, req.state, {})
            run, index = req.tag.get("run"), req.tag.get("index")
            message = (
                f"{_edit_named(edit) if edit is not None else 'an edit'} raised{at} on request "
                f"{req.req_id if index is None else index}: {type(error).__name__}: {error}. The request "
                "ran on without its edits and the engine is unharmed; give a value that fits the point "
                "(hs.collect(llm, prompt, point) shows its shape)"
            )
            log.warning("hookscope: %s", message)
            if run is not None or self.blocks:
                self.faults.append(Fault(run, index, point, message))

    def faults_of_run(self, run: str) -> list[Fault]:
        """The faults of a call's requests, taken (reported once)."""
        mine = [f for f in self.faults if f.run == run]
        self.faults = [f for f in self.faults if f.run != run]
        return mine

    def faults_of_block(self, block: str) -> list[Fault]:
        """The faults at the points a block edits of requests no call tagged (the engine's own
        `generate` inside it), taken (reported once)."""
        points = {self.arch.spec(edit.point).name for edit in self.blocks.get(block, ())}
        mine = [f for f in self.faults if f.run is None and (f.point in points or not f.point)]
        self.faults = [f for f in self.faults if f not in mine]
        return mine
