"""A logits processor for the tests only: an engine step that holds a request asking
`"test.step_s": S` in its extra args sleeps S seconds, so that the request is surely still running
when a test acts on the server (a SIGTERM that must find it in flight: on an idle machine the tiny
test model makes 190 tokens in well under a second, before the client has read the first one).
`vllm serve` loads it in its workers by import path (FLAG; tests/kit is on the servers' PYTHONPATH,
vllm_server.start). Requests that do not ask are not slowed, and no request's logits change."""

from __future__ import annotations

import time

from vllm.v1.sample.logits_processor import LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

KEY = "test.step_s"
FLAG = "vllm_slow_steps:SlowSteps"


class SlowSteps(LogitsProcessor):
    def __init__(self, vllm_config, device, is_pin_memory: bool) -> None:
        self.step_s: dict[int, float] = {}  # batch index -> seconds each step of that request takes

    def is_argmax_invariant(self) -> bool:
        return False  # vLLM skips an argmax-invariant processor for greedy requests: this one must run

    def update_state(self, batch_update) -> None:
        process_dict_updates(
            self.step_s, batch_update, lambda params, _, __: (params.extra_args or {}).get(KEY)
        )

    def apply(self, logits):
        if self.step_s:
            time.sleep(max(self.step_s.values()))
        return logits
