"""What runs inside vLLM's workers: hooks on the model, rows attributed to their requests.

`Extension` is vLLM's `worker_extension_cls`: vLLM mixes it into its worker class in every worker
process, and the caller reaches its methods by name with `LLM.collective_rpc("hookscope_...")`, whose
arguments and results are plain data (names, tags, tensors): nothing executable crosses processes,
so vLLM's default layout (the engine core and its workers in their own processes) works as is.

A forward holds the flattened tokens of many requests (`[num_tokens, ...]`, chunked prefill and
decode mixed). The model's root pre-hook reads, once per forward, which requests are in it
(batch.py) and the `positions` the model is called with; each point's hook then copies the token
rows of the requests this capture tagged (their `SamplingParams.extra_args`) and files them under
(request, point) with their positions. A capture's edits (edits.py) are attached before its
hooks, so a captured point that is also edited is kept as edited.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ...arch.base import ROOT
from ...errors import EngineError, SelectionError
from ...hooks import Hook, Hooks, hook_count
from ...selection import Selection
from . import sharded, tables
from .batch import InPass, requests_in_pass
from .capture_store import RequestWriter, client_id
from .edits import RequestEdits, rebuild_selection


class _RequestDims:
    """The dims of one request's rows, `[tokens, ...]`, for a positions `Selection`."""

    pos_dim, head_dim = 0, None


REQUEST_ROWS = _RequestDims()

log = logging.getLogger("hookscope")


@dataclass
class _Slot:
    """One tagged request's tokens in this forward: rows [lo, hi) of the forward's kept rows (the
    tagged requests' rows, gathered once per point), at `positions`; `key`: what the capture files
    them under (`Session.request_key`)."""

    key: Hashable
    lo: int
    hi: int
    positions: Tensor


class Session:
    """One capture's hooks in one worker, and the rows they filed: (request index, point) -> parts,
    one per forward that held the request, in the order they ran; and its requests' edits
    (`edits`: request index -> described edits, see edits.py), applied on every forward before any
    point is kept.

    `selection` (edits.describe_selection): heads and dtype are taken from each forward's kept rows;
    positions are the request's own, over its prompt (a prefill capture's): only the rows at the
    positions they name are kept, whichever forwards hold them, and `take` puts them in the
    selection's order. A selection that does not fit is kept as its error, for `take` to raise (an
    error in a forward would stop the engine)."""

    def __init__(
        self,
        runner,
        model: nn.Module,
        arch,
        names: list[str],
        run: str,
        prefill_only: bool,
        edits: dict | None = None,
        edit_on: str = "both",
        selection: dict | None = None,
    ):
        self.runner, self.run, self.prefill_only = runner, run, prefill_only
        asked = rebuild_selection(selection)
        self.selection = Selection.of(heads=asked.heads, dtype=asked.dtype)  # taken from every kept row
        self.positions = None if asked.positions is None else Selection.of(positions=asked.positions)
        self.named: dict[int, Tensor | None] = {}  # request index -> the positions it keeps, in order
        self.refused: list[str] = []  # what did not fit the activations or a request
        arch, self.gathered = sharded.for_rank(arch, model)  # tensor parallelism: {sharded point: dim}
        self.slots: list[_Slot] = []
        self.rows: Tensor | None = None  # this forward's kept token rows, for one index_select per point
        self.parts: dict[tuple[int, str], list[tuple[Tensor, Tensor]]] = defaultdict(list)
        self.hooks = Hooks(model, arch)
        if edits:
            RequestEdits(runner, model, arch, self.hooks, run, edits, edit_on, split=self.gathered)
        self.hooks.module_pre_forward(ROOT, self._pass_start)
        for name in names:
            self.hooks.forward(arch.spec(name), self._keep)

    def _pass_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        self.slots, rows, kept = [], [], 0
        for req in requests_in_pass(self.runner):
            key = self.request_key(req)
            if key is None:
                continue  # another request (or another capture's): not ours to keep
            # a copy: `positions` is a view of the runner's buffer, which the next forward overwrites
            pos = positions[req.start : req.end].to("cpu", copy=True)
            index = torch.arange(req.start, req.end)
            if self.prefill_only:
                prompt = len(req.state.prompt_token_ids or ())
                if int(pos[-1]) >= prompt:  # decode tokens in this chunk: keep the prompt's only
                    index, pos = index[pos < prompt], pos[pos < prompt]
            if self.positions is not None:
                index, pos = self._named_only(key, len(req.state.prompt_token_ids or ()), index, pos)
            if pos.numel():
                self.slots.append(_Slot(key, kept, kept + pos.numel(), pos))
                rows.append(index)
                kept += pos.numel()
        self.rows = torch.cat(rows) if rows else None

    def _named_only(self, request: int, length: int, index: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        """The rows `index` (at positions `pos` of a request of `length` positions) whose positions
        the selection names."""
        named = self._named(request, length)
        keep = torch.isin(pos, named) if named is not None else torch.zeros_like(pos, dtype=torch.bool)
        return index[keep], pos[keep]

    def _named(self, request: int, length: int) -> Tensor | None:
        """The positions the selection names in a request of `length`, in its order ("last", negative
        and slice positions read as `hs.collect` reads them); None where they do not fit it."""
        if request not in self.named:
            try:
                named = self.positions.select(torch.arange(length), REQUEST_ROWS).contiguous()
            except SelectionError as e:
                named, why = None, str(e)
            else:
                why = "the positions name none of its tokens (the engine hands back no empty rows)"
            self.named[request] = named if named is not None and named.numel() else None
            if self.named[request] is None:
                self.refused.append(f"prompt {request} ({length} tokens): {why}")
        return self.named[request]

    def request_key(self, req: InPass) -> Hashable | None:
        """What this capture files a request's rows under (its index among the capture's requests),
        or None for a request that is not this capture's."""
        return int(req.tag["index"]) if req.tag.get("run") == self.run else None

    def _keep(self, act: Tensor, hook: Hook) -> None:
        if self.rows is None:
            return
        # one gather per point and forward (a copy: vLLM's fused norms write their inputs in place
        # later in the same forward); each request's part is a slice of it
        kept = act.detach().index_select(0, self.rows.to(act.device))
        name = hook.spec.name
        if name in self.gathered:  # this rank's columns: every rank's, whole
            kept = sharded.gather(kept, self.gathered[name])
        try:  # (heads counted in the whole tensor: after the gather)
            kept = self.selection.take(kept, hook.spec, copy=False).cpu()
        except SelectionError as e:
            self.refused.append(f"{name}: {e}")
            self.rows = None  # nothing more of this forward
            return
        for slot in self.slots:
            self.parts[(slot.key, name)].append((slot.positions, kept[slot.lo : slot.hi]))

    def take(self, expected: dict[int, int]) -> dict[int, dict[str, list[Tensor]]]:
        """Every request's parts per point, checked whole and in order: positions 0..n-1 each exactly
        once (`expected`: request index -> n), never silently short; with a positions selection, the
        positions it names, in its order."""
        if self.refused:
            raise SelectionError(self.refused[0])
        out: dict[int, dict[str, list[Tensor]]] = defaultdict(dict)
        for (index, name), parts in self.parts.items():
            n = expected.get(index)
            named = self.named.get(index) if self.positions is not None else None
            want = None if named is None else named.flatten().unique()  # (sorted)
            out[index][name] = in_order(parts, n, f"request {index}, {name}", want)
            if named is not None:  # the selection's order and shape (an int drops the position dim)
                out[index][name] = [torch.cat(out[index][name])[torch.searchsorted(want, named)]]
        return dict(out)

    def close(self) -> None:
        self.hooks.remove()


def in_order(
    parts: list[tuple[Tensor, Tensor]], n: int | None, what: str, want: Tensor | None = None
) -> list[Tensor]:
    """The rows of `parts` ((positions, rows) per forward), checked whole and in order: positions
    0..n-1 (or the sorted positions `want`) each exactly once. Raises EngineError, naming `what`,
    for rows that came back short."""
    positions = torch.cat([p for p, _ in parts])
    want = torch.arange(n or 0) if want is None else want
    if n is None or not torch.equal(positions, want.to(positions.dtype)):
        got = positions.tolist()
        raise EngineError(
            f"{what}: rows for positions {got[:8]}{'...' if len(got) > 8 else ''} "
            f"({len(got)} rows), not 0..{(n or 0) - 1} once each in order: vLLM skipped, repeated "
            "or reordered tokens' forward (prefix caching, preemption); capture with "
            "enable_prefix_caching=False"
        )
    return [rows for _, rows in parts]


class StoreSession(Session):
    """Under `vllm serve`, the server's capture: the prompt rows of every request that asked
    (`"hookscope.capture": 1`), filed by vLLM's request id and handed to the store's writer
    (capture_store.py) once the prompt's last token has run. On ranks after the first, `writer` is
    None: they take part in the gathers of tensor-parallel points only."""

    def __init__(self, runner, model: nn.Module, arch, names: list[str], writer: RequestWriter | None):
        super().__init__(runner, model, arch, names, "served", prefill_only=True)
        self.names, self.writer = names, writer
        self.asked: dict[str, tuple[str, list[int]]] = {}  # req id -> (key, prompt ids), until written
        self.written: set[str] = set()  # of the requests the runner still holds
        self.hooks.module_forward(ROOT, self._pass_end)

    def request_key(self, req: InPass) -> Hashable | None:
        if "capture" not in req.tag:
            return None
        req_id = req.state.req_id
        if req_id in self.written:
            return None  # its prompt run again after a preemption: its rows are in the store
        if req_id not in self.asked:
            key = req.tag["capture"] or client_id(req_id)
            self.asked[req_id] = (key, list(req.state.prompt_token_ids or ()))
        return req_id

    def _pass_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        super()._pass_start(module, args, kwargs)
        for slot in self.slots:
            if int(slot.positions[0]) == 0:  # its first tokens (again, after a preemption): start over
                self._drop(slot.key)

    def _pass_end(self, module: nn.Module, args: tuple, output) -> None:
        for slot in self.slots:
            if int(slot.positions[-1]) == len(self.asked[slot.key][1]) - 1:
                self._write(slot.key)
        self.slots = []
        held = self.runner.requests
        for req_id in [r for r in self.asked if r not in held]:  # aborted before its prompt ran
            del self.asked[req_id]
            self._drop(req_id)
        if self.written:
            self.written.intersection_update(held)

    def _drop(self, req_id: str) -> None:
        for name in self.names:
            self.parts.pop((req_id, name), None)

    def _write(self, req_id: str) -> None:
        key, prompt = self.asked.pop(req_id)
        self.written.add(req_id)
        try:
            rows = {
                name: torch.cat(
                    in_order(self.parts.pop((req_id, name)), len(prompt), f"request {key!r}, {name}")
                )
                for name in self.names
            }
        except EngineError as e:  # the server keeps serving; the store never holds a short request
            log.warning("hookscope: %s; its rows are not written", e)
            return
        if self.writer is not None:
            self.writer.write(key, prompt, rows)


# where the worker hands its rows to the caller: shared memory where the system has it (the engine's
# workers and the caller of an offline LLM share one machine)
HANDOFF_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
ALIGN = 64  # every tensor's offset in the handoff file, so that any dtype can view its bytes


def hand_off(rows: dict[int, dict[str, list[Tensor]]], run: str) -> list:
    """Write every request's rows (its parts, one after another) into one file in shared memory;
    return where each lies: [path, [[request, point, dtype, shape, offset], ...]]. Only this small
    index crosses vLLM's RPC (msgpack through the engine core): the rows are never serialized."""
    path = handoff_path(run)
    try:
        return [path, _write_rows(path, rows)]
    except BaseException:
        discard(run)  # nobody will read a file cut short
        raise


def _write_rows(path: str, rows: dict[int, dict[str, list[Tensor]]]) -> list:
    index, offset = [], 0
    with open(path, "wb") as f:
        for i, points in rows.items():
            for name, parts in points.items():
                pad = -offset % ALIGN
                f.write(b"\0" * pad)
                offset += pad
                first = parts[0]
                shape = [sum(p.shape[0] for p in parts), *first.shape[1:]]
                index.append([i, name, str(first.dtype).removeprefix("torch."), shape, offset])
                for part in parts:
                    data = memoryview(part.contiguous().view(torch.uint8).flatten().numpy())
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
    selection the workers found not to fit, raised."""
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


class Steering:
    """Named steering vectors registered in one worker, applied per request: a request whose
    `extra_args["hookscope"]["steer"]` lists `[name, scale]` pairs gets `scale * vector` added at the
    vector's point on every one of its tokens (prefill and decode), and no other request does."""

    def __init__(self, runner, model: nn.Module, arch):
        self.runner, self.arch = runner, arch
        self.vectors: dict[str, tuple[str, Tensor]] = {}  # name -> (point, vector)
        self.rows: dict[str, tuple[Tensor, Tensor]] = {}  # name -> (token rows, scales) this forward
        self.hooks = Hooks(model, arch)
        self.hooks.module_pre_forward(ROOT, self._pass_start)
        self.attached: set[str] = set()
        self.split_points = sharded.for_rank(arch, model)[1]  # tensor parallelism: per-rank shards

    def register(self, name: str, point: str, vector: Tensor) -> None:
        spec = self.arch.spec(point)
        spec.require_writable("steering")
        if spec.name in self.split_points:
            raise EngineError(
                f"steering {spec.name} on a tensor-parallel engine, whose ranks each hold a slice of it: "
                "steer a point every rank holds whole (resid_*, attn.out, mlp.out) or use "
                "tensor_parallel_size=1"
            )
        self.vectors[name] = (spec.name, vector)
        if spec.name not in self.attached:  # one hook per point, for every vector there
            self.hooks.forward(spec, self._steer)
            self.attached.add(spec.name)

    def _pass_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        found: dict[str, tuple[list, list]] = {}
        for req in requests_in_pass(self.runner):
            for name, scale in req.tag.get("steer", ()):
                rows, scales = found.setdefault(name, ([], []))
                rows.append(torch.arange(req.start, req.end))
                scales.append(torch.full((req.end - req.start,), float(scale)))
        self.rows = {name: (torch.cat(r), torch.cat(s)) for name, (r, s) in found.items()}

    def _steer(self, act: Tensor, hook: Hook) -> Tensor | None:
        out = None
        for name, (rows, scales) in self.rows.items():
            point, vector = self.vectors[name]
            if point != hook.spec.name:
                continue
            out = act.clone() if out is None else out
            add = scales.to(act.device, act.dtype)[:, None] * vector.to(act.device, act.dtype)
            out.index_add_(0, rows.to(act.device), add.reshape(len(rows), *act.shape[1:]))
        return out


class Extension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); the caller calls these by name."""

    def _hookscope_model(self) -> nn.Module:
        return (
            self.model_runner.get_model()
            if hasattr(self.model_runner, "get_model")
            else self.model_runner.model
        )

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
        and their `edits` (request index -> edits described as plain data, edits.py); returns the
        model class."""
        model = self._hookscope_model()
        expected = tables.model_class(architecture)
        if type(model).__name__ != expected:
            raise EngineError(
                f"vLLM built {type(model).__name__} for {architecture}, not {expected}: hookscope's table "
                "describes the latter's modules"
            )
        sessions = self.__dict__.setdefault("_hookscope_sessions", {})
        arch = tables.table(architecture, self.model_runner.model_config.hf_config)
        sessions[run] = Session(
            self.model_runner, model, arch, names, run, prefill_only, edits, edit_on, selection
        )
        return type(model).__name__

    def hookscope_take(self, run: str, expected: dict) -> list:
        """The capture's rows per request, handed off in shared memory (`hand_off`), its hooks removed."""
        session = self.__dict__.get("_hookscope_sessions", {}).pop(run, None)
        if session is None:
            raise EngineError(f"no hookscope capture {run!r} in this worker")
        try:
            rows = session.take({int(k): int(v) for k, v in expected.items()})
        except SelectionError as e:  # the caller's: raised there (an error here reaches it as any error)
            return {"refused": str(e)}
        finally:
            session.close()
        return hand_off(rows, run) if sharded.hands_off() else None

    def hookscope_hook_count(self) -> int:
        """Hooks on the model's modules now (tests: none is left after a capture)."""
        return hook_count(self._hookscope_model())

    def hookscope_steer(self, architecture: str, name: str, point: str, vector: list) -> None:
        """Register steering vector `name` at `point` (requests choose it by name in extra_args)."""
        steering = self.__dict__.get("_hookscope_steering")
        if steering is None:
            model = self._hookscope_model()
            arch = tables.table(architecture, self.model_runner.model_config.hf_config)
            steering = self.__dict__["_hookscope_steering"] = Steering(self.model_runner, model, arch)
        steering.register(name, point, torch.tensor(vector))

    def hookscope_serve_store(
        self, architecture: str, names: list[str], out: str, settings: dict, shard_rows: int
    ) -> None:
        """Under `vllm serve`: capture `names` on the prompts of the requests that ask, into the store
        at `out` (capture_store.py)."""
        model = self._hookscope_model()
        arch = tables.table(architecture, self.model_runner.model_config.hf_config)
        writer = RequestWriter(out, settings, shard_rows) if sharded.hands_off() else None
        self.__dict__["_hookscope_store"] = StoreSession(self.model_runner, model, arch, names, writer)

    def hookscope_stop(self, run: str) -> None:
        """Remove a capture's hooks (after an error)."""
        session = self.__dict__.get("_hookscope_sessions", {}).pop(run, None)
        if session is not None:
            session.close()
