"""Which requests one forward of a vLLM worker holds, and where their tokens lie in it.

A forward holds the flattened tokens of many requests (`[num_tokens, ...]`, chunked prefill and
decode mixed). Before the model runs, the model runner's batch says which requests are in it (in
order), where each one's tokens start (`query_start_loc`) and how many of its tokens earlier
forwards computed (its first position here); a request's `SamplingParams.extra_args["hookscope"]`
says what hookscope is to do with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

TAG = "hookscope"  # the key of a request's SamplingParams.extra_args that hookscope reads
# the OpenAI server's `vllm_xargs` hold no nested dicts: a served request asks for a vector with one
# flat key per vector, {"hookscope.steer.<name>": scale}
STEER_KEY = TAG + ".steer."
# a served request's prompt rows go into the server's store: {"hookscope.capture": 1}, filed under its
# request id or under {"hookscope.capture_id": "..."} (capture_store.py)
CAPTURE_KEY = TAG + ".capture"
CAPTURE_ID_KEY = TAG + ".capture_id"


def tag_of(extra: dict) -> dict | None:
    """What hookscope is to do with a request: its tag, with the vectors HTTP's flat keys ask for
    under "steer" and its store capture under "capture" (the capture id it gave, or None); None for
    a request hookscope has nothing to do with."""
    tag = extra.get(TAG)
    tag = dict(tag) if isinstance(tag, dict) else None
    flat = [[key[len(STEER_KEY) :], value] for key, value in extra.items() if key.startswith(STEER_KEY)]
    if flat:
        tag = tag or {}
        tag["steer"] = [*tag.get("steer", ()), *flat]
    if extra.get(CAPTURE_KEY):
        tag = tag or {}
        tag["capture"] = extra.get(CAPTURE_ID_KEY)
    return tag


def steering_asked(extra: dict | None) -> list[tuple[str, float]]:
    """The (vector name, scale) pairs a request's `extra_args` ask for: `{"hookscope": {"steer":
    [[name, scale], ...]}}` (the Python API's) and `{"hookscope.steer.<name>": scale}` (HTTP's)."""
    tag = tag_of(extra or {})
    return [tuple(pair) for pair in tag.get("steer", ())] if tag else []


@dataclass(frozen=True)
class InPass:
    """One request's tokens in this forward: rows [start, end), at positions from `offset` on."""

    tag: dict
    start: int
    end: int
    offset: int
    state: Any  # the model runner's state of the request (its prompt's token ids)


def requests_in_pass(runner) -> Iterator[InPass]:
    """The requests of the forward about to run that carry a hookscope tag, in the forward's order."""
    batch = runner.input_batch
    n = batch.num_reqs
    starts = runner.query_start_loc.cpu[: n + 1].tolist()
    for i, req_id in enumerate(batch.req_ids[:n]):
        state = runner.requests[req_id]
        extra = (state.sampling_params.extra_args or {}) if state.sampling_params is not None else {}
        tag = tag_of(extra)
        if tag is not None:
            offset = int(batch.num_computed_tokens_cpu[i])
            yield InPass(tag, starts[i], starts[i + 1], offset, state)
