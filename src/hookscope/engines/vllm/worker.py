"""What runs inside vLLM's workers: hooks on the model, rows attributed to their requests.

`Extension` is vLLM's `worker_extension_cls`: vLLM mixes it into its worker class in every worker
process, and the caller reaches its methods by name with `LLM.collective_rpc("hookscope_...")`, whose
arguments and results are plain data (names, tags, tensors): nothing executable crosses processes,
so vLLM's default layout (the engine core and its workers in their own processes) works as is.

A forward holds the flattened tokens of many requests (`[num_tokens, ...]`, chunked prefill and
decode mixed). The model's one root pre-hook (`Forwards`) reads, once per forward, which requests
are in it and where each one's tokens lie (batch.py), and hands that to the edit path (edits.py)
and to each capture; a capture's point hooks then copy the token rows of the requests it tagged
(their `SamplingParams.extra_args`) and file them under (request, point) with their positions;
under `vllm serve`, the store's capture (`StoreSession`) is one more such capture. A capture's edits
are attached before its hooks, so a captured point that is also edited is kept as edited.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing.util
import os
import tempfile
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ...arch.base import ROOT
from ...errors import EditFailed, EngineError, HookscopeError, SelectionError
from ...hooks import Hook, Hooks, hook_count
from ...selection import Selection
from . import compiled, sharded, tables
from .batch import InPass, PassReader, Rows
from .capture_store import WRITER_EXIT, RequestWriter, client_id
from .edits import RequestEdits, fault_message, rebuild_selection

log = logging.getLogger("hookscope")

STORE_RUN = "served"  # the store's capture under `vllm serve`, among a worker's captures


class _RequestDims:
    """The dims of one request's rows, `[tokens, ...]`, for a positions `Selection`."""

    pos_dim, head_dim = 0, None


REQUEST_ROWS = _RequestDims()


class _Slot(NamedTuple):
    """One tagged request's tokens in this forward: rows [lo, hi) of the forward's kept rows (the
    tagged requests' rows, gathered once per point), at `positions` (a range, or the positions a
    selection names); `key`: what the capture files them under (`Session.request_key`)."""

    key: Hashable
    lo: int
    hi: int
    positions: Sequence[int]


class _Named(NamedTuple):
    """The positions a selection names in one request: in the selection's order and shape, and
    sorted once each (the rows the forwards keep)."""

    order: Tensor
    rows: list[int]


class Joined(NamedTuple):
    """One point's rows of every request of a capture: `joined` holds them one request after another,
    `parts` each request's (request index -> a view of `joined`, in that order), for one write of
    them all."""

    joined: Tensor
    parts: dict[Hashable, Tensor]


class Session:
    """One capture's hooks in one worker, and the rows they kept: each point's rows of each forward,
    joined per request (the forwards that held it, in the order they ran) by `take`.
    `Forwards` hands it each forward's requests (`pass_start`); its requests' edits run on the
    worker's one edit path (edits.py), attached before its hooks, so a captured point that is also
    edited is kept as edited.

    `selection` (edits.describe_selection): heads and dtype are taken from each forward's kept rows;
    positions are the request's own, over its prompt (a prefill capture's): only the rows at the
    positions they name are kept, whichever forwards hold them, and `take` puts them in the
    selection's order. A selection that does not fit is kept as its error, for `take` to raise (an
    error in a forward would stop the engine)."""

    def __init__(
        self,
        model: nn.Module,
        arch,
        gathered: dict,
        names: list[str],
        run: str,
        prefill_only: bool,
        selection: dict | None = None,
    ):
        self.run, self.prefill_only, self.gathered, self.names = run, prefill_only, gathered, names
        asked = rebuild_selection(selection)
        self.selection = Selection.of(heads=asked.heads, dtype=asked.dtype)  # taken from every kept row
        self.positions = None if asked.positions is None else Selection.of(positions=asked.positions)
        self.named: dict[Hashable, _Named | None] = {}  # request -> the positions it keeps
        self.refused: list[str] = []  # what did not fit the activations or a request
        self.slots: list[_Slot] = []
        self.rows: Rows | None = None  # this forward's kept token rows, for one gather per point
        # (key, lo, hi, index among the forward's requests) of each slot, where a forward of the same
        # requests at the same rows keeps the same rows at positions that only move on (a generation's
        # decode steps): its slots are then this with the requests' new positions
        self.template: list[tuple[Hashable, int, int, int]] | None = None
        # point -> (its kept rows, the forward's slots) per forward, joined per request by `take`
        self.kept: dict[str, list[tuple[Tensor, list[_Slot]]]] = defaultdict(list)
        self.hooks = Hooks(model, arch)
        for name in names:
            self.hooks.forward(arch.spec(name), self._keep)

    def pass_start(self, requests: list[InPass], same_rows: bool = False) -> None:
        """This forward's slots and rows, from its requests (`same_rows`: the same requests at the
        same rows as the forward before)."""
        if not self.hooks:  # (a call with edits and nothing to capture)
            return
        if same_rows and self.template is not None:
            self.slots = [
                _Slot(key, lo, hi, range(requests[i].offset, requests[i].offset + hi - lo))
                for key, lo, hi, i in self.template
            ]
            return
        self.slots, spans, kept, indices = [], [], 0, []
        for i, req in enumerate(requests):
            key = self.request_key(req)
            if key is None:
                continue  # another request (or another capture's): not ours to keep
            n = req.end - req.start
            if self.prefill_only:  # decode tokens in this chunk: keep the prompt's only
                n = min(n, len(req.state.prompt_token_ids or ()) - req.offset)
            positions: Sequence[int] = range(req.offset, req.offset + n)
            if self.positions is not None and positions:
                positions = self._named_in(key, len(req.state.prompt_token_ids or ()), positions)
            if positions:
                self.slots.append(_Slot(key, kept, kept + len(positions), positions))
                indices.append(i)
                spans += _spans(req, positions)
                kept += len(positions)
        self.rows = Rows(spans) if spans else None
        # every request's whole rows kept at its own positions (no prompt-only cut, no named positions)
        whole = not self.prefill_only and self.positions is None
        self.template = (
            [(*slot[:3], i) for slot, i in zip(self.slots, indices, strict=True)] if whole else None
        )

    def _named_in(self, key: Hashable, length: int, held: range) -> list[int]:
        """The positions of `held` (this forward's, of a request of `length` positions) that the
        selection names, in order."""
        named = self._named(key, length)
        if named is None:
            return []
        return named.rows[bisect_left(named.rows, held.start) : bisect_left(named.rows, held.stop)]

    def _named(self, request: Hashable, length: int) -> _Named | None:
        """The positions the selection names in a request of `length`, in its order ("last", negative
        and slice positions read as `hs.collect` reads them); None where they do not fit it."""
        if request not in self.named:
            try:
                named = self.positions.select(torch.arange(length), REQUEST_ROWS).contiguous()
            except SelectionError as e:
                named, why = None, str(e)
            else:
                why = "the positions name none of its tokens (the engine hands back no empty rows)"
            fits = named is not None and named.numel()
            self.named[request] = _Named(named, named.flatten().unique().tolist()) if fits else None
            if not fits:
                self.refused.append(f"prompt {request} ({length} tokens): {why}")
        return self.named[request]

    def request_key(self, req: InPass) -> Hashable | None:
        """What this capture files a request's rows under (its index among the capture's requests),
        or None for a request that is not this capture's."""
        return int(req.tag["index"]) if req.tag.get("run") == self.run else None

    def _keep(self, act: Tensor, hook: Hook) -> None:
        if self.rows is None:
            return
        # one gather per point and forward; each request's part is a slice of it
        kept = self.rows.take(act.detach())
        name = hook.spec.name
        if name in self.gathered:  # this rank's columns: every rank's, whole
            kept = sharded.gather(kept, self.gathered[name])
        try:  # (heads counted in the whole tensor: after the gather)
            kept = self.selection.take(kept, hook.spec, copy=False).cpu()
        except SelectionError as e:
            self.refused.append(f"{name}: {e}")
            self.rows = None  # nothing more of this forward
            return
        self.kept[name].append((kept, self.slots))

    def take(self, expected: dict[int, int]) -> dict[str, Joined]:
        """Every request's rows per point, checked whole and in order: positions 0..n-1 each exactly
        once (`expected`: request index -> n), never silently short; with a positions selection, the
        positions it names, in its order. Per point, the forwards' rows are joined once and each
        request's gathered from them into its part of one tensor, one request after another
        (`Joined`, for one write of them all)."""
        if self.refused:
            raise SelectionError(self.refused[0])
        out: dict[str, Joined] = {}
        for name in self.names:
            forwards = self.kept.get(name, [])
            where: dict[Hashable, list[int]] = defaultdict(list)  # request -> its rows in `rows`
            positions: dict[Hashable, list[int]] = defaultdict(list)
            base = 0
            for kept, slots in forwards:
                for slot in slots:
                    where[slot.key] += range(base + slot.lo, base + slot.hi)
                    positions[slot.key] += slot.positions
                base += kept.shape[0]
            for index in expected:  # a request none of whose rows came (no hook ran) is checked too
                positions.setdefault(index, [])
            named = {
                index: self.named.get(index) if self.positions is not None else None for index in positions
            }
            for index, got in positions.items():
                want = named[index]
                check_order(
                    got, expected.get(index), f"request {index}, {name}", None if want is None else want.rows
                )
            if not forwards:  # (no rows asked of it either: the checks passed)
                continue
            rows = torch.cat([kept for kept, _ in forwards])
            picks = {}  # request -> its rows of `rows`, in the selection's order and shape where it has one
            for index, want in named.items():
                pick = torch.tensor(where[index], dtype=torch.long)
                # (an int selection drops the position dim: a 0-d pick)
                picks[index] = (
                    pick if want is None else pick[torch.searchsorted(torch.tensor(want.rows), want.order)]
                )
            counts = [pick.numel() for pick in picks.values()]
            joined = rows.new_empty((sum(counts), *rows.shape[1:]))
            parts = dict(zip(picks, joined.split(counts), strict=True))
            for index, pick in picks.items():  # each request's rows gathered straight into its part
                torch.index_select(rows, 0, pick.reshape(-1), out=parts[index])
                parts[index] = parts[index].view(*pick.shape, *rows.shape[1:])
            out[name] = Joined(joined, parts)
        self.kept.clear()
        return out

    def close(self) -> None:
        self.hooks.remove()


def _spans(req: InPass, positions: Sequence[int]) -> list[tuple[int, int]]:
    """Where a request's tokens at `positions` lie in the forward: one span for a range, a span of
    one row per named position (`Rows` merges the ones that touch)."""
    if isinstance(positions, range):
        start = req.start + positions.start - req.offset
        return [(start, start + len(positions))]
    return [(req.start + p - req.offset, req.start + p - req.offset + 1) for p in positions]


def in_order(
    parts: list[tuple[Sequence[int], Tensor]], n: int | None, what: str, want: list[int] | None = None
) -> list[Tensor]:
    """The rows of `parts` ((positions, rows) per forward), checked whole and in order (`check_order`)."""
    check_order([q for positions, _ in parts for q in positions], n, what, want)
    return [rows for _, rows in parts]


def check_order(got: list[int], n: int | None, what: str, want: list[int] | None = None) -> None:
    """Positions kept of a request, in the order they ran: 0..n-1 (or the sorted positions `want`)
    each exactly once. Raises EngineError, naming `what`, for rows that came back short."""
    if n is None or got != (list(range(n)) if want is None else want):
        raise EngineError(
            f"{what}: rows for positions {got[:8]}{'...' if len(got) > 8 else ''} "
            f"({len(got)} rows), not 0..{(n or 0) - 1} once each in order: vLLM skipped, repeated "
            "or reordered tokens' forward (prefix caching, preemption); capture with "
            "enable_prefix_caching=False"
        )


class _Asked(NamedTuple):
    """A request the store's capture keeps rows of: what its rows are filed under, its prompt, and
    the model runner's state of it (its generated tokens, read when it is written)."""

    key: str
    prompt: list[int]
    state: Any


class StoreSession(Session):
    """Under `vllm serve`, the server's capture: the rows of every request that asked
    (`"hookscope.capture": 1`), filed by vLLM's request id and handed to the store's writer
    (capture_store.py). With `generated`, every token the model runs for the request, prompt and
    generated, handed over once vLLM has let go of it (finished, stopped or aborted: its model
    runner drops the request's state at the step after, which the next forward's start, or the
    worker's exit, finds); else its prompt's only, handed over at the end of the forward that ran
    the prompt's last token (its own root forward hook). On ranks after the first, `writer` is None:
    they take part in the gathers of tensor-parallel points only."""

    def __init__(
        self,
        runner,
        model: nn.Module,
        arch,
        gathered: dict,
        names: list[str],
        writer: RequestWriter | None,
        generated: bool,
    ):
        super().__init__(model, arch, gathered, names, STORE_RUN, prefill_only=not generated)
        self.runner, self.writer = runner, writer
        self.asked: dict[str, _Asked] = {}  # req id -> the request, until written
        self.written: set[str] = set()  # prompt rows only: of the requests the runner still holds
        self.parts: dict[tuple[Hashable, str], list[tuple[Sequence[int], Tensor]]] = defaultdict(list)
        self.hooks.module_forward(ROOT, self._pass_end)
        if generated:  # the requests that ended after the last forward, before the writer closes
            multiprocessing.util.Finalize(self, self._write_ended, exitpriority=WRITER_EXIT + 1)

    def request_key(self, req: InPass) -> Hashable | None:
        if "capture" not in req.tag:
            return None
        req_id = req.req_id
        if req_id in self.written:
            return None  # its prompt run again after a preemption: its rows are in the store
        if req_id not in self.asked:
            key = req.tag["capture"] or client_id(req_id)
            self.asked[req_id] = _Asked(key, list(req.state.prompt_token_ids or ()), req.state)
        return req_id

    def pass_start(self, requests: list[InPass], same_rows: bool = False) -> None:
        if not self.prefill_only:
            self._write_ended()
        super().pass_start(requests, same_rows)
        for slot in self.slots:
            if slot.positions[0] == 0:  # its first tokens (again, after a preemption): start over
                self._drop(slot.key)

    def _pass_end(self, module: nn.Module, args: tuple, output) -> None:
        self._cut(self.parts)
        if self.prefill_only:
            for slot in self.slots:
                if slot.positions[-1] == len(self.asked[slot.key].prompt) - 1:
                    self._write(slot.key)
            held = self.runner.requests
            for req_id in [r for r in self.asked if r not in held]:  # aborted before its prompt ran
                del self.asked[req_id]
                self._drop(req_id)
            if self.written:
                self.written.intersection_update(held)
        self.slots = []

    def _write_ended(self) -> None:
        """The requests the model runner no longer holds, written (those whose prompt never ran
        whole, dropped)."""
        held = self.runner.requests
        for req_id in [r for r in self.asked if r not in held]:
            self._write(req_id)

    def _cut(self, into: dict[tuple[Hashable, str], list[tuple[Sequence[int], Tensor]]]) -> None:
        """The rows kept so far, cut per request and point (`into`: (key, point) -> (positions, rows)
        per forward, appended in the order they ran), and let go of."""
        for name, forwards in self.kept.items():
            for kept, slots in forwards:
                for slot in slots:
                    into[(slot.key, name)].append((slot.positions, kept[slot.lo : slot.hi]))
        self.kept.clear()

    def _drop(self, req_id: str) -> None:
        for name in self.names:
            self.parts.pop((req_id, name), None)

    def _write(self, req_id: str) -> None:
        asked = self.asked.pop(req_id)
        if self.prefill_only:
            self.written.add(req_id)
            tokens = asked.prompt
        else:  # every token run: the prompt's and the generated ones but the last sampled
            tokens = [*asked.prompt, *asked.state.output_token_ids[:-1]]
        parts = {name: self.parts.pop((req_id, name), []) for name in self.names}
        if sum(len(positions) for positions, _ in parts[self.names[0]]) < len(asked.prompt):
            return  # aborted before its prompt ran whole: nothing of it is written
        try:
            rows = {
                name: torch.cat(in_order(parts[name], len(tokens), f"request {asked.key!r}, {name}"))
                for name in self.names
            }
        except EngineError as e:  # the server keeps serving; the store never holds a short request
            log.warning("hookscope: %s; its rows are not written", e)
            return
        if self.writer is not None:
            self.writer.write(asked.key, tokens, len(asked.prompt), rows)


# where the worker hands its rows to the caller: shared memory where the system has it (the engine's
# workers and the caller of an offline LLM share one machine)
HANDOFF_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
# where each point's rows start in the handoff file, so that any dtype can view its bytes (a request's
# rows of a point lie at a multiple of their element size after it)
ALIGN = 64


def hand_off(rows: dict[str, Joined], run: str) -> list:
    """Write every request's rows into one file in shared memory, one write per point; return where
    each request's lie: [path, [[request, point, dtype, shape, offset], ...]]. Only this small index
    crosses vLLM's RPC (msgpack through the engine core): the rows are never serialized."""
    path = handoff_path(run)
    try:
        return [path, _write_rows(path, rows)]
    except BaseException:
        discard(run)  # nobody will read a file cut short
        raise


def _write_rows(path: str, rows: dict[str, Joined]) -> list:
    index, offset = [], 0
    with open(path, "wb") as f:
        for name, (joined, parts) in rows.items():
            pad = -offset % ALIGN
            f.write(b"\0" * pad)
            offset += pad
            dtype = str(joined.dtype).removeprefix("torch.")
            at = offset
            for i, part in parts.items():  # the parts lie one after another in `joined`
                index.append([i, name, dtype, list(part.shape), at])
                at += part.numel() * part.element_size()
            data = memoryview(joined.view(torch.uint8).flatten().numpy())
            f.write(data)
            offset += len(data)
    return index


def handoff_path(run: str) -> str:
    return os.path.join(HANDOFF_DIR, f"hookscope-{run}")


def discard(run: str) -> None:
    """Remove a capture's handoff file, if there is one: the caller gave up before taking it over."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(handoff_path(run))


def take_over(handoff: list) -> dict[int, dict[str, Tensor]]:
    """The caller's side: the rows read from the handoff file (one read), which is then removed; a
    selection the workers found not to fit, or edits that raised in their forwards, raised."""
    if isinstance(handoff, dict) and "failed" in handoff:
        raise EditFailed(handoff["failed"])
    if isinstance(handoff, dict):
        raise SelectionError(handoff["refused"])
    path, index = handoff
    try:
        size = os.path.getsize(path)
        buf = torch.from_file(path, shared=False, size=size, dtype=torch.uint8) if size else torch.empty(0)
    finally:
        os.unlink(path)
    out: dict[int, dict[str, Tensor]] = defaultdict(dict)
    for i, name, dtype, shape, offset in index:
        dt = getattr(torch, dtype)
        n = math.prod(shape) * torch.empty(0, dtype=dt).element_size()
        out[int(i)][name] = buf[offset : offset + n].view(dt).reshape(shape)
    return dict(out)


class Forwards:
    """hookscope's work in one worker's forwards. While anything is active (a capture, a named edit,
    an `hs.edit` block: then every request, tagged or not) one root pre-hook reads the forward's
    requests once (batch.py: each request's tag read on its first forward, kept by request id) and
    hands them to the one edit path (edits.py) and to each capture; with nothing active, no hook is
    left on the model."""

    def __init__(self, runner, model: nn.Module, arch):
        self.runner, self.model = runner, model
        # a compiled engine whose maker consented: a forward that holds a tagged request runs uncompiled
        self.hold_eager = compiled.holds_eager(runner.vllm_config)
        self.arch, self.gathered = sharded.for_rank(arch, model)  # tensor parallelism: {sharded point: dim}
        self.passes = PassReader()
        self.edits = RequestEdits(model, self.arch, split=self.gathered)
        self.sessions: dict[str, Session] = {}
        self.root: Hooks | None = None

    def start(
        self,
        names: list[str],
        run: str,
        prefill_only: bool,
        edits: dict | None,
        edit_on: str,
        selection: dict | None = None,
    ) -> None:
        """A capture of `names` for the requests tagged `run`, keeping what `selection` selects, and
        their `edits`."""
        if edits:  # attached before the capture's hooks: a captured point that is edited is kept edited
            self.edits.add_run(run, edits, edit_on)
        try:
            session = Session(self.model, self.arch, self.gathered, names, run, prefill_only, selection)
        except BaseException:
            self.edits.drop_run(run)
            raise
        self.sessions[run] = session
        self._watch()

    def serve_store(self, names: list[str], writer: RequestWriter | None, generated: bool) -> None:
        """Under `vllm serve`: the store's capture of `names` (the generated tokens' too, with
        `generated`), one more capture handed each forward's requests (after the named edits
        registered before it, so it keeps edited rows)."""
        store = StoreSession(self.runner, self.model, self.arch, self.gathered, names, writer, generated)
        self.sessions[STORE_RUN] = store
        self._watch()

    def stop(self, run: str) -> Session | None:
        """Remove a capture's hooks and its edits; the capture, for its rows (None if unknown)."""
        session = self.sessions.pop(run, None)
        if session is not None:
            session.close()
        self.edits.drop_run(run)
        self._watch()
        return session

    def name_edit(self, name: str, described: dict) -> None:
        self.edits.name(name, described)
        self._watch()

    def open_block(self, block: str, edits: list[dict]) -> None:
        """An `hs.edit` block's edits, on every request until `close_block`."""
        self.edits.open_block(block, edits)
        self._watch()

    def close_block(self, block: str) -> str | None:
        """Close an `hs.edit` block; what its edits' faults were, if they raised (edits.py)."""
        faults = self.edits.faults_of_block(block)
        self.edits.close_block(block)
        self._watch()
        return fault_message(faults) if faults else None

    def _watch(self) -> None:
        """The root pre-hook, on while something is active, off when nothing is."""
        active = bool(self.sessions) or self.edits.active()
        if active and self.root is None:
            self.root = Hooks(self.model, self.arch)
            self.root.module_pre_forward(ROOT, self._pass_start)
        elif not active and self.root is not None:
            self.root.remove()
            self.root = None

    def _pass_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        requests, same_rows = self.passes.read(self.runner, every=self.edits.every_request())
        if requests and self.hold_eager:  # else vLLM's compiled graph runs without the hooks
            compiled.run_this_forward_uncompiled()
        if self.edits.active():
            self.edits.pass_start(requests, self.runner.requests, same_rows)
        for session in self.sessions.values():
            session.pass_start(requests, same_rows)


def failure(message: str) -> dict:
    """Edits that raised in the workers' forwards as the reply, for the caller to raise as EditFailed."""
    return {"failed": message}


def refusal(error: HookscopeError) -> dict:
    """A worker's refusal as its reply, for the caller to raise (`raise_refusals`, `take_over`).
    Every rank of a tensor-parallel engine refuses alike, and vLLM raises the first rank's error and
    leaves the others' queued, for the next call to read as its own reply."""
    return {"refused": str(error)}


def raise_refusals(replies: list) -> list:
    """The workers' replies to a call, or the EngineError one of them refused with (EditFailed for
    edits that raised in their forwards)."""
    for reply in replies:
        if isinstance(reply, dict) and "failed" in reply:
            raise EditFailed(reply["failed"])
        if isinstance(reply, dict) and "refused" in reply:
            raise EngineError(reply["refused"])
    return replies


class Extension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); the caller calls these by name."""

    def _hookscope_model(self) -> nn.Module:
        return (
            self.model_runner.get_model()
            if hasattr(self.model_runner, "get_model")
            else self.model_runner.model
        )

    def _hookscope_forwards(self, architecture: str) -> Forwards:
        forwards = self.__dict__.get("_hookscope_work")
        if forwards is None:
            model = self._hookscope_model()
            expected = tables.model_class(architecture)
            if type(model).__name__ != expected:
                raise EngineError(
                    f"vLLM built {type(model).__name__} for {architecture}, not {expected}: hookscope's "
                    "table describes the latter's modules"
                )
            arch = tables.table(architecture, self.model_runner.model_config.hf_config)
            forwards = self.__dict__["_hookscope_work"] = Forwards(self.model_runner, model, arch)
        return forwards

    def hookscope_start(
        self,
        architecture: str,
        names: list[str],
        run: str,
        prefill_only: bool = True,
        edits: dict | None = None,
        edit_on: str = "both",
        selection: dict | None = None,
    ) -> str:
        """Attach a capture of `names` for the requests tagged `run`, keeping what `selection` selects,
        and their `edits` (as `edits.on_the_wire` sends them: each distinct edit described as plain data
        once, each request's as indices); returns the model class."""
        forwards = self._hookscope_forwards(architecture)
        try:
            forwards.start(names, run, prefill_only, edits, edit_on, selection)
        except EngineError as e:
            return refusal(e)
        return type(forwards.model).__name__

    def hookscope_take(self, run: str, expected: dict) -> list:
        """The capture's rows per request, handed off in shared memory (`hand_off`), its hooks removed."""
        forwards = self.__dict__.get("_hookscope_work")
        faults = forwards.edits.faults_of_run(run) if forwards is not None else []
        session = forwards.stop(run) if forwards is not None else None
        if session is None:
            raise EngineError(f"no hookscope capture {run!r} in this worker")
        if faults:  # the caller's: its rows are not what it asked for
            return failure(fault_message(faults))
        try:
            rows = session.take({int(k): int(v) for k, v in expected.items()})
        except SelectionError as e:  # the caller's: raised there (an error here reaches it as any error)
            return refusal(e)
        return hand_off(rows, run) if sharded.hands_off() else None

    def hookscope_hook_count(self) -> int:
        """Hooks on the model's modules now (tests: none is left after a capture)."""
        return hook_count(self._hookscope_model())

    def hookscope_name_edit(self, architecture: str, name: str, described: dict) -> dict | None:
        """Register edit `name` (a steering vector or an ablation, described as plain data, edits.py):
        requests ask for it by name in their extra_args."""
        try:
            self._hookscope_forwards(architecture).name_edit(name, described)
        except EngineError as e:
            return refusal(e)
        return None

    def hookscope_open_edits(self, architecture: str, block: str, edits: list[dict]) -> dict | None:
        """Open `hs.edit` block `block`: its edits (described as plain data, edits.py) on every token
        of every request the engine runs until `hookscope_close_edits`."""
        try:
            self._hookscope_forwards(architecture).open_block(block, edits)
        except EngineError as e:
            return refusal(e)
        return None

    def hookscope_close_edits(self, block: str) -> dict | None:
        """Close `hs.edit` block `block`: its edits and the hooks only they needed removed; the
        faults of its edits that raised in a forward, as `failure`."""
        forwards = self.__dict__.get("_hookscope_work")
        failed = forwards.close_block(block) if forwards is not None else None
        return failure(failed) if failed else None

    def hookscope_serve_store(
        self,
        architecture: str,
        names: list[str],
        out: str,
        settings: dict,
        shard_rows: int,
        generated: bool = True,
    ) -> None:
        """Under `vllm serve`: capture `names` on the requests that ask (their prompts, and with
        `generated` their generated tokens), into the store at `out` (capture_store.py)."""
        forwards = self._hookscope_forwards(architecture)
        writer = RequestWriter(out, settings, shard_rows) if sharded.hands_off() else None
        forwards.serve_store(names, writer, generated)

    def hookscope_stop(self, run: str) -> None:
        """Remove a capture's hooks (after an error)."""
        forwards = self.__dict__.get("_hookscope_work")
        if forwards is not None:
            forwards.stop(run)
