"""Which requests one forward of a vLLM worker holds, and where their tokens lie in it.

A forward holds the flattened tokens of many requests (`[num_tokens, ...]`, chunked prefill and
decode mixed). Before the model runs, the model runner's batch says which requests are in it (in
order), where each one's tokens start (`query_start_loc`) and how many of its tokens earlier
forwards computed (its first position here); a request's `SamplingParams.extra_args["hookscope"]`
says what hookscope is to do with it: read once per request (its extra_args do not change
between its forwards), kept by request id while the request lives (`PerRequest`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
from torch import Tensor

TAG = "hookscope"  # the key of a request's SamplingParams.extra_args that hookscope reads
# the OpenAI server's `vllm_xargs` hold no nested dicts: a served request asks for a named edit with
# one flat key per edit, {"hookscope.steer.<name>": scale} or {"hookscope.ablate.<name>": 1}
STEER_KEY = TAG + ".steer."
ABLATE_KEY = TAG + ".ablate."
FLAT_KEYS = {"steer": STEER_KEY, "ablate": ABLATE_KEY}  # the tag's entry -> its flat key's prefix
# a served request's prompt rows go into the server's store: {"hookscope.capture": 1}, filed under its
# request id or under {"hookscope.capture_id": "..."} (capture_store.py)
CAPTURE_KEY = TAG + ".capture"
CAPTURE_ID_KEY = TAG + ".capture_id"
UNTAGGED: Mapping[str, Any] = MappingProxyType({})  # the tag of a request hookscope was not asked about


def tag_of(extra: dict) -> dict | None:
    """What hookscope is to do with a request: its tag, with the named edits HTTP's flat keys ask for
    under "steer" / "ablate" ([name, value] pairs) and its store capture under "capture" (the capture
    id it gave, or None); None for a request hookscope has nothing to do with."""
    tag = extra.get(TAG)
    tag = dict(tag) if isinstance(tag, dict) else None
    for entry, prefix in FLAT_KEYS.items():
        flat = [[key[len(prefix) :], value] for key, value in extra.items() if key.startswith(prefix)]
        if flat:
            tag = tag or {}
            tag[entry] = [*tag.get(entry, ()), *flat]
    if extra.get(CAPTURE_KEY):
        tag = tag or {}
        tag["capture"] = extra.get(CAPTURE_ID_KEY)
    return tag


def named_asked(extra: dict | None, entry: str) -> list[tuple[str, Any]]:
    """The (name, value) pairs a request's `extra_args` ask for under `entry` ("steer": vector name
    and scale; "ablate": ablation name and 1 / 0): `{"hookscope": {entry: [[name, value], ...]}}`
    (the Python API's) and `{"hookscope.<entry>.<name>": value}` (HTTP's)."""
    tag = tag_of(extra or {})
    return [tuple(pair) for pair in tag.get(entry, ())] if tag else []


class InPass(NamedTuple):
    """One request's tokens in this forward: rows [start, end), at positions from `offset` on (the
    tokens earlier forwards computed: vLLM's positions of a request's tokens count on from there)."""

    req_id: str
    tag: dict
    start: int
    end: int
    offset: int
    state: Any  # the model runner's state of the request (its prompt's token ids)


class PerRequest:
    """Something made once per request and kept while the request lives: keyed by vLLM's request id,
    checked against the runner's state of the request (an id reused by a new request is made anew),
    and forgotten once the runner no longer holds the request."""

    def __init__(self):
        self.made: dict[str, tuple[Any, Any]] = {}  # request id -> (its runner state, what was made)

    def get(self, req_id: str, state: Any, make: Callable[[Any], Any], arg: Any) -> Any:
        """What `make(arg)` made for the request, made on its first call."""
        kept = self.made.get(req_id)
        if kept is not None and kept[0] is state:
            return kept[1]
        value = make(arg)
        self.made[req_id] = (state, value)
        return value

    def put(self, req_id: str, state: Any, value: Any) -> None:
        """`value` made for the request from now on (in place of what `get` made)."""
        self.made[req_id] = (state, value)

    def forget_finished(self, live: Any) -> None:
        """Drop what was made for requests not in `live` (the runner's requests), once they pile up."""
        if len(self.made) > 2 * len(live) + 64:
            self.made = {req_id: kept for req_id, kept in self.made.items() if req_id in live}


def _tag(state: Any) -> dict | None:
    extra = state.sampling_params.extra_args if state.sampling_params is not None else None
    return tag_of(extra) if extra else None


class PassReader:
    """Which requests each forward about to run holds (`read`). A forward of the same requests at the
    same rows as the forward before (a generation's decode steps) is told from one comparison of the
    batch's request ids, their runner states and row starts, and read without walking its requests
    again: only their positions move on. Each request's tag is read on its first forward and kept
    while it lives (`tags`)."""

    def __init__(self):
        self.tags = PerRequest()
        self.batch: tuple | None = None  # the last forward's whole batch: ids, states' ids, starts, `every`
        self.states: list = []  # its states, held so that no new state can take one of their ids
        self.found: list[InPass] = []  # its requests that carry a tag (`every`: all)
        self.indices: list[int] = []  # each one's index in that batch

    def read(self, runner, every: bool = False) -> tuple[list[InPass], bool]:
        """The requests of the forward about to run that carry a hookscope tag (`every`: all of them,
        an untagged one with an empty tag), in the forward's order, and whether they are the same
        requests at the same rows as in the forward before."""
        batch = runner.input_batch
        n = batch.num_reqs
        ids = batch.req_ids[:n]
        held = runner.requests
        states = [held[req_id] for req_id in ids]
        starts = runner.query_start_loc.cpu[: n + 1].tolist()
        whole = (ids, list(map(id, states)), starts, every)
        if whole == self.batch:
            computed = batch.num_computed_tokens_cpu[:n].tolist()
            self.found = [
                InPass(req.req_id, req.tag, req.start, req.end, computed[i], req.state)
                for i, req in zip(self.indices, self.found, strict=True)
            ]
            return self.found, True
        self.tags.forget_finished(held)
        found, indices = [], []
        computed = None
        for i, (req_id, state) in enumerate(zip(ids, states, strict=True)):
            tag = self.tags.get(req_id, state, _tag, state)
            if tag is None:
                if not every:
                    continue
                tag = UNTAGGED
            if computed is None:  # (read only for a forward that holds a tagged request)
                computed = batch.num_computed_tokens_cpu[:n].tolist()
            found.append(InPass(req_id, tag, starts[i], starts[i + 1], computed[i], state))
            indices.append(i)
        # the requests found at the same rows, where others around them came or went
        same = [(r.req_id, r.state, r.start, r.end) for r in found] == [
            (r.req_id, r.state, r.start, r.end) for r in self.found
        ]
        self.batch, self.states, self.found, self.indices = whole, states, found, indices
        return found, same


class Rows:
    """Some token rows of a forward, spans [start, end) in the forward's order: read and written as one
    slice where the spans touch (the usual case: a call's requests run side by side), else through
    one index."""

    def __init__(self, spans: list[tuple[int, int]]):
        merged: list[list[int]] = []
        for start, end in spans:
            if merged and merged[-1][1] == start:
                merged[-1][1] = end
            else:
                merged.append([start, end])
        self.span = tuple(merged[0]) if len(merged) == 1 else None
        self.index = None if self.span else torch.cat([torch.arange(s, e) for s, e in merged])

    def covers(self, n: int) -> bool:
        return self.span == (0, n)

    def take(self, act: Tensor) -> Tensor:
        """The rows of `act`, a copy (vLLM writes some activations in place later in the forward)."""
        if self.span is not None:
            return act[self.span[0] : self.span[1]].clone()
        return act.index_select(0, self.index.to(act.device))

    def put(self, out: Tensor, new: Tensor) -> None:
        if self.span is not None:
            out[self.span[0] : self.span[1]] = new
        else:
            out.index_copy_(0, self.index.to(out.device), new)
