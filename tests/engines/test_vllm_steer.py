"""Per-request steering: a vector registered by name in the workers, asked for by 2 of 8 requests in
their SamplingParams.extra_args, changes those 2 exactly as Hugging Face with hs.steer on every token
(prefill and decode: the logprobs of each generated token), and leaves the other 6's tokens and
logprobs as they are without it.
"""

from __future__ import annotations

import pytest
import torch
from gate import need

need("vllm")

from vllm_models import assert_close, hf_model  # noqa: E402

import hookscope as hs  # noqa: E402
from hookscope.engines import vllm as hv  # noqa: E402

POINT, SCALE, STEERED = "blocks.0.resid_post", 3.0, (1, 5)


@pytest.fixture(scope="module")
def llama(edit_llama, shared_vllm):
    """The shared in-process llama (vllm_shared.start_edit_llama): the vector crosses vLLM's RPC
    as in the default layout. Stopped after this file: the vector registered here stays on it."""
    yield edit_llama.directory, edit_llama.llm
    shared_vllm.release("edit_llama")


def test_two_steered_requests_change_alone(llama):
    from vllm import SamplingParams

    directory, llm = llama
    vector = torch.randn(256, generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 250, (n,), generator=g).tolist() for n in (5, 17, 33, 64, 9, 40, 70, 12)]
    greedy = {"max_tokens": 4, "temperature": 0.0, "logprobs": 0, "detokenize": False}
    requests = [{"prompt_token_ids": p} for p in prompts]
    # the baseline before any vector is registered: a steering hook that reached every request
    # would otherwise move the baseline too
    plain = llm.generate(requests, SamplingParams(**greedy), use_tqdm=False)
    hv.register_vector(llm, "v", POINT, vector)
    params = [
        SamplingParams(**greedy, extra_args=hv.steering(("v", SCALE)) if i in STEERED else None)
        for i in range(len(prompts))
    ]
    mixed = llm.generate(requests, params, use_tqdm=False)
    hf = hf_model(directory)
    for i, (prompt, before, after) in enumerate(zip(prompts, plain, mixed, strict=True)):
        tokens = list(after.outputs[0].token_ids)
        got = torch.tensor([next(iter(step.values())).logprob for step in after.outputs[0].logprobs])
        ids = torch.tensor([prompt + tokens[:-1]])
        n = len(prompt)
        if i not in STEERED:
            assert tokens == list(before.outputs[0].token_ids), i
            want = torch.tensor([next(iter(s.values())).logprob for s in before.outputs[0].logprobs])
            assert_close(got, want, f"request {i}, unsteered, vs before")
            with torch.no_grad():  # and against Hugging Face, unsteered (teacher forcing)
                logprobs = hf(ids).logits[0].log_softmax(-1)
            want = torch.stack([logprobs[n - 1 + k, t] for k, t in enumerate(tokens)])
            assert_close(got, want, f"request {i}, unsteered, vs Hugging Face", rel=1e-4)
            continue
        # Hugging Face, steered on every position, fed the tokens vLLM generated (teacher forcing)
        with torch.no_grad(), hs.edit(hf, hs.steer(POINT, vector, scale=SCALE)):
            logprobs = hf(ids).logits[0].log_softmax(-1)
        want = torch.stack([logprobs[n - 1 + k, t] for k, t in enumerate(tokens)])
        assert_close(got, want, f"request {i}, steered", rel=1e-4)
        with torch.no_grad():
            unsteered = hf(ids).logits[0].log_softmax(-1)
        moved = torch.stack([unsteered[n - 1 + k, t] for k, t in enumerate(tokens)])
        assert (moved - want).abs().max() > 1e-3, "the steering changed nothing: the test cannot tell"


def test_steering_is_refused_under_prefix_caching(tmp_path):
    class Cache:
        enable_prefix_caching = True

    from test_vllm_requests import fake_llm

    llm = fake_llm()
    llm.llm_engine.vllm_config.cache_config = Cache()
    with pytest.raises(hs.EngineError, match="enable_prefix_caching=False"):
        hv.register_vector(llm, "v", POINT, torch.zeros(256))
