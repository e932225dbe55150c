"""`vllm serve` writing the captures of the requests that ask into a hookscope store.

The operator names a store directory and its points in hookscope's `--additional-config` (beside
or instead of a vectors file, serve.py):

    --additional-config '{"hookscope": {"store": "acts", "points": ["blocks.1.resid_post"]}}'

and a request opts in with `"vllm_xargs": {"hookscope.capture": 1}`. Its prompt's rows at those
points go into the store (`ShardWriter`: the format, manifest and crash promises of `hookscope
extract`), written by the first worker as soon as the prompt's last token has run: one batch per
request, a shard committed each time `shard_rows` rows fill it, the last one when the server stops.
Each row's `doc_ids` is `doc_id(key)`, where `key` is the request's own `hookscope.capture_id` if
it gave one, else vLLM's id of it: a completion's `id` and `-{i}` for its i-th prompt
(`cmpl-...-0`), a chat completion's `id`. The capture is the worker's `Session` (worker.py), on the
same table: no second capture.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing.util
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ...arch.base import ROOT
from ...errors import EngineError, StoreError
from ...loading import sha256_text
from ...store import ShardWriter
from ...store.resume import plan_for
from . import check_config, resolve, sharded
from .batch import CAPTURE_ID_KEY, CAPTURE_KEY, InPass
from .worker import Session, in_order

log = logging.getLogger("hookscope")

# seconds vLLM gives its processes to stop (--shutdown-timeout): the first worker's last shard is
# written and committed in them
SHUTDOWN_TIMEOUT = 30
# what the server's capture is named among the worker's captures (an offline one by a uuid)
SERVED = "served"
HOW = (
    'serve with --additional-config \'{"hookscope": {"store": "DIR", "points": ["blocks.1.resid_post"]}}\' '
    '(optionally "shard_rows": N, the rows of a shard; 65536 unless given)'
)


@dataclass(frozen=True)
class StoreOptions:
    """The store part of hookscope's `--additional-config`."""

    out: str
    points: list[str]
    shard_rows: int = 65536


def store_options(settings: dict[str, Any]) -> StoreOptions | None:
    """The store the operator asked for in hookscope's settings, checked; None if none."""
    out, points, shard_rows = settings.get("store"), settings.get("points"), settings.get("shard_rows", 65536)
    if out is None and points is None:
        return None
    if not isinstance(out, str) or not out:
        raise EngineError(f"hookscope's settings give points but no store directory: {HOW}")
    if isinstance(points, str):
        points = [p.strip() for p in points.split(",") if p.strip()]
    if not points or not isinstance(points, list) or not all(isinstance(p, str) for p in points):
        raise EngineError(f"hookscope's store {out!r} needs its points, a list of names: {HOW}")
    if isinstance(shard_rows, bool) or not isinstance(shard_rows, int) or shard_rows < 1:
        raise EngineError(f"hookscope's shard_rows must be a whole number >= 1, got {shard_rows!r}: {HOW}")
    return StoreOptions(out, points, shard_rows)


def store_call(config, options: StoreOptions) -> tuple:
    """The arguments of the workers' `hookscope_serve_store` for a server with this `VllmConfig`:
    plain data, checked before any worker is called (the points, prefix caching, a grace period to
    stop in, and a store already in the directory made with other settings, refused with what
    differs)."""
    architecture, arch = check_config(config)
    if config.cache_config.enable_prefix_caching:
        # a prompt's cached tokens never run their forward, so their rows would be missing
        raise EngineError(
            "hookscope's store needs every prompt token's forward, which prefix caching skips for "
            "cached tokens: serve with --no-enable-prefix-caching"
        )
    if not config.shutdown_timeout:
        # vLLM's default (0) kills the workers at once when the server stops: the last shard is lost
        raise EngineError(
            "hookscope's store commits its last shard when the server stops, which vLLM allows only "
            f"with a grace period: serve with --shutdown-timeout {SHUTDOWN_TIMEOUT} (seconds)"
        )
    names = list(resolve(arch, options.points).values())
    model = config.model_config
    settings = {
        "source": "vllm serve",
        "model": model.model,
        "model_class": architecture,
        "config_sha256": sha256_text(model.hf_config.to_json_string(use_diff=False)),
        "points": names,
        "dtype": str(model.dtype).removeprefix("torch."),
    }
    plan_for(options.out, settings, 1)  # a store of other settings: refused here, naming what differs
    return architecture, names, options.out, settings, options.shard_rows


def check_capture(params, store: str | None) -> None:
    """Raises ValueError (vLLM's HTTP 400) for a request asking for a capture this server cannot
    write: no store, `n` > 1 (whose rows would share one prompt), a malformed flag or capture id."""
    extra = params.extra_args or {}
    asked = extra.get(CAPTURE_KEY)
    if CAPTURE_KEY in extra and (isinstance(asked, float) or asked not in (0, 1)):
        raise ValueError(f'"{CAPTURE_KEY}" is 1 (capture this request) or 0, got {asked!r}')
    given = extra.get(CAPTURE_ID_KEY)
    if CAPTURE_ID_KEY in extra and (not asked or not isinstance(given, str) or not given):
        raise ValueError(
            f'"{CAPTURE_ID_KEY}" names a captured request\'s rows: a non-empty string, with '
            f'"{CAPTURE_KEY}": 1; got {given!r}'
        )
    if not asked:
        return
    if store is None:
        raise ValueError(f"this server writes no hookscope store, so it cannot capture a request: {HOW}")
    if params.n > 1:
        raise ValueError(
            f"a captured request asks for one completion (n=1, got n={params.n}): its prompt's rows "
            "are filed once"
        )


def doc_id(key: str) -> int:
    """The store's `doc_ids` value of the rows of the request filed under `key`: the first 8 bytes
    of the SHA-256 of its UTF-8, little-endian, halved (a non-negative int64)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def client_id(req_id: str) -> str:
    """vLLM's request id as its API server named it: the engine adds "-" and 8 random characters
    (`InputProcessor.assign_request_id`) unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is set."""
    from vllm import envs

    return req_id if envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION else req_id.rsplit("-", 1)[0]


class StoreSession(Session):
    """The server's capture in one worker: the prompt rows of every request that asked, filed by
    vLLM's request id and written once the prompt's last token has run (on the first rank; the
    others take part in the gathers of tensor-parallel points only)."""

    def __init__(self, runner, model: nn.Module, arch, names: list[str], writer: ShardWriter | None):
        super().__init__(runner, model, arch, names, SERVED, prefill_only=True)
        self.names, self.writer = names, writer
        self.next_batch = 1 + max(writer.done_batches, default=-1) if writer is not None else 0
        self.asked: dict[str, tuple[str, list[int]]] = {}  # req id -> (key, prompt ids), until written
        self.written: set[str] = set()  # of the requests the runner still holds
        self.hooks.module_forward(ROOT, self._pass_end)

    @classmethod
    def open(cls, runner, model, arch, names, out: str, settings: dict, shard_rows: int) -> StoreSession:
        """The session, its store opened (or resumed) on the first rank, and closed, its last shard
        committed, when the worker's process exits."""
        writer = ShardWriter(out, settings, shard_rows=shard_rows) if sharded.hands_off() else None
        session = cls(runner, model, arch, names, writer)
        # run as a multiprocessing child (vLLM's engine core and workers) ends, and at interpreter exit
        multiprocessing.util.Finalize(session, session.finish, exitpriority=10)
        return session

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
                for name in self.names:
                    self.parts.pop((slot.key, name), None)

    def _pass_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        for slot in self.slots:
            if int(slot.positions[-1]) == len(self.asked[slot.key][1]) - 1:
                self._write(slot.key)
        self.slots = []
        held = self.runner.requests
        for req_id in [r for r in self.asked if r not in held]:  # aborted before its prompt ran
            del self.asked[req_id]
            for name in self.names:
                self.parts.pop((req_id, name), None)
        if self.written:
            self.written.intersection_update(held)

    def _write(self, req_id: str) -> None:
        key, prompt = self.asked.pop(req_id)
        self.written.add(req_id)
        n = len(prompt)
        try:
            rows = {
                name: torch.cat(in_order(self.parts.pop((req_id, name)), n, f"request {key!r}, {name}"))
                for name in self.names
            }
        except EngineError as e:  # the server keeps serving; the store never holds a short request
            log.warning("hookscope: %s; its rows are not written", e)
            return
        if self.writer is None:
            return
        batch = self.next_batch
        self.next_batch += 1
        try:
            self.writer.write(batch, rows, columns(prompt, key, batch))
        except StoreError as e:
            log.error("hookscope: writing the store failed, no more requests are captured: %s", e)
            self.writer = None

    def finish(self) -> None:
        """The hooks removed and the store closed: its last shard committed."""
        self.close()
        if self.writer is not None:
            try:
                self.writer.close()
            except StoreError as e:
                log.error("hookscope: closing the store failed: %s", e)
            self.writer = None


def columns(prompt: list[int], key: str, batch: int) -> dict[str, Tensor]:
    """A captured request's meta columns: its tokens, `doc_id(key)`, positions, and its batch."""
    n = len(prompt)
    return {
        "token_ids": torch.tensor(prompt, dtype=torch.int64),
        "doc_ids": torch.full((n,), doc_id(key), dtype=torch.int64),
        "positions": torch.arange(n),
        "seq_ids": torch.full((n,), batch, dtype=torch.int64),
    }
