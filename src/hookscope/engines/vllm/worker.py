"""What runs inside vLLM's workers: hooks on the model, rows attributed to their requests.

`Extension` is vLLM's `worker_extension_cls`: vLLM mixes it into its worker class in every worker
process, and the caller reaches its methods by name with `LLM.collective_rpc("hookscope_...")`, whose
arguments and results are plain data (names, tags, tensors): nothing executable crosses processes,
so vLLM's default layout (the engine core and its workers in their own processes) works as is.

A forward holds the flattened tokens of many requests (`[num_tokens, ...]`, chunked prefill and
decode mixed). The model's one root pre-hook (`Forwards`) reads, once per forward, which requests
are in it and where each one's tokens lie (batch.py), and hands that to the edit path (edits.py)
and to each capture; a capture's point hooks then copy the token rows of the requests it tagged
(their `SamplingParams.extra_args`) and file them under (request, point) with their positions. A
capture's edits are attached before its hooks, so a captured point that is also edited is kept as
edited.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections import defaultdict
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ...arch.base import ROOT
from ...errors import EngineError
from ...hooks import Hook, Hooks, hook_count
from . import sharded, tables
from .batch import InPass, PerRequest, Rows, requests_in_pass
from .edits import RequestEdits


class _Slot(NamedTuple):
    """One tagged request's tokens in this forward: rows [lo, hi) of the forward's kept rows (the
    tagged requests' rows, gathered once per point), at positions from `offset` on."""

    index: int
    lo: int
    hi: int
    offset: int


class Session:
    """One capture's hooks in one worker, and the rows they kept: each point's rows of each forward,
    cut into each request's parts (one per forward that held it, in the order they ran) by `take`.
    `Forwards` hands it each forward's requests (`pass_start`); its requests' edits run on the
    worker's one edit path (edits.py), attached before its hooks, so a captured point that is also
    edited is kept as edited."""

    def __init__(
        self, model: nn.Module, arch, gathered: dict, names: list[str], run: str, prefill_only: bool
    ):
        self.run, self.prefill_only, self.gathered = run, prefill_only, gathered
        self.slots: list[_Slot] = []
        self.rows: Rows | None = None  # this forward's kept token rows, for one gather per point
        # point -> (its kept rows, the forward's slots) per forward, cut per request in `take`
        self.kept: dict[str, list[tuple[Tensor, list[_Slot]]]] = defaultdict(list)
        self.hooks = Hooks(model, arch)
        for name in names:
            self.hooks.forward(arch.spec(name), self._keep)

    def pass_start(self, requests: list[InPass]) -> None:
        if not self.hooks:  # (a call with edits and nothing to capture)
            return
        self.slots, spans, kept = [], [], 0
        for req in requests:
            tag = req.tag
            if tag.get("run") != self.run:
                continue  # another request (or another capture's): not ours to keep
            n = req.end - req.start
            if self.prefill_only:  # decode tokens in this chunk: keep the prompt's only
                n = min(n, len(req.state.prompt_token_ids or ()) - req.offset)
            if n > 0:
                self.slots.append(_Slot(int(tag["index"]), kept, kept + n, req.offset))
                spans.append((req.start, req.start + n))
                kept += n
        self.rows = Rows(spans) if spans else None

    def _keep(self, act: Tensor, hook: Hook) -> None:
        if self.rows is None:
            return
        # one gather per point and forward; each request's part is a slice of it
        kept = self.rows.take(act.detach())
        name = hook.spec.name
        if name in self.gathered:  # this rank's columns: every rank's, whole
            kept = sharded.gather(kept, self.gathered[name])
        self.kept[name].append((kept.cpu(), self.slots))

    def take(self, expected: dict[int, int]) -> dict[int, dict[str, list[Tensor]]]:
        """Every request's parts per point, checked whole and in order: positions 0..n-1 each exactly
        once (`expected`: request index -> n), never silently short."""
        # (request index, point) -> (first position, rows) per forward that held the request
        parts_of: dict[tuple[int, str], list[tuple[int, Tensor]]] = defaultdict(list)
        for name, forwards in self.kept.items():
            for kept, slots in forwards:
                for slot in slots:
                    parts_of[(slot.index, name)].append((slot.offset, kept[slot.lo : slot.hi]))
        out: dict[int, dict[str, list[Tensor]]] = defaultdict(dict)
        for (index, name), parts in parts_of.items():
            got = [q for offset, rows in parts for q in range(offset, offset + rows.shape[0])]
            n = expected.get(index)
            if n is None or got != list(range(n)):
                raise EngineError(
                    f"request {index}, {name}: rows for positions {got[:8]}{'...' if len(got) > 8 else ''} "
                    f"({len(got)} rows), not 0..{(n or 0) - 1} once each in order: vLLM skipped, repeated "
                    "or reordered tokens' forward (prefix caching, preemption); capture with "
                    "enable_prefix_caching=False"
                )
            out[index][name] = [rows for _, rows in parts]
        return dict(out)

    def close(self) -> None:
        self.hooks.remove()


# where the worker hands its rows to the caller: shared memory where the system has it (the engine's
# workers and the caller of an offline LLM share one machine)
HANDOFF_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
ALIGN = 64  # every tensor's offset in the handoff file, so that any dtype can view its bytes


def hand_off(rows: dict[int, dict[str, list[Tensor]]], run: str) -> list:
    """Write every request's rows (its parts, one after another) into one file in shared memory;
    return where each lies: [path, [[request, point, dtype, shape, offset], ...]]. Only this small
    index crosses vLLM's RPC (msgpack through the engine core): the rows are never serialized."""
    path = os.path.join(HANDOFF_DIR, f"hookscope-{run}")
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
    return [path, index]


def take_over(handoff: list) -> dict[int, dict[str, Tensor]]:
    """The caller's side: the rows read from the handoff file (one read), which is then removed."""
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
    """hookscope's work in one worker's forwards. While anything is active (a capture, a named edit)
    one root pre-hook reads the forward's requests once (batch.py: each request's tag read on its
    first forward, kept by request id) and hands them to the one edit path (edits.py) and to each
    capture; with nothing active, no hook is left on the model."""

    def __init__(self, runner, model: nn.Module, arch):
        self.runner, self.model = runner, model
        self.arch, self.gathered = sharded.for_rank(arch, model)  # tensor parallelism: {sharded point: dim}
        self.tags = PerRequest()
        self.edits = RequestEdits(model, self.arch, split=self.gathered)
        self.sessions: dict[str, Session] = {}
        self.root: Hooks | None = None

    def start(self, names: list[str], run: str, prefill_only: bool, edits: dict | None, edit_on: str) -> None:
        """A capture of `names` for the requests tagged `run`, and their `edits`."""
        if edits:  # attached before the capture's hooks: a captured point that is edited is kept edited
            self.edits.add_run(run, edits, edit_on)
        try:
            session = Session(self.model, self.arch, self.gathered, names, run, prefill_only)
        except BaseException:
            self.edits.drop_run(run)
            raise
        self.sessions[run] = session
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
        requests = requests_in_pass(self.runner, self.tags)
        self.edits.pass_start(requests, self.runner.requests)
        for session in self.sessions.values():
            session.pass_start(requests)


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
    ) -> str:
        """Attach a capture of `names` for the requests tagged `run`, and their `edits` (request
        index -> edits described as plain data, edits.py); returns the model class."""
        forwards = self._hookscope_forwards(architecture)
        forwards.start(names, run, prefill_only, edits, edit_on)
        return type(forwards.model).__name__

    def hookscope_take(self, run: str, expected: dict) -> list:
        """The capture's rows per request, handed off in shared memory (`hand_off`), its hooks removed."""
        forwards = self.__dict__.get("_hookscope_work")
        session = forwards.stop(run) if forwards is not None else None
        if session is None:
            raise EngineError(f"no hookscope capture {run!r} in this worker")
        rows = session.take({int(k): int(v) for k, v in expected.items()})
        return hand_off(rows, run) if sharded.hands_off() else None

    def hookscope_hook_count(self) -> int:
        """Hooks on the model's modules now (tests: none is left after a capture)."""
        return hook_count(self._hookscope_model())

    def hookscope_name_edit(self, architecture: str, name: str, described: dict) -> None:
        """Register edit `name` (a steering vector or an ablation, described as plain data, edits.py):
        requests ask for it by name in their extra_args."""
        self._hookscope_forwards(architecture).name_edit(name, described)

    def hookscope_stop(self, run: str) -> None:
        """Remove a capture's hooks (after an error)."""
        forwards = self.__dict__.get("_hookscope_work")
        if forwards is not None:
            forwards.stop(run)
