"""An edit that raises inside a vLLM worker's forward (a value whose shape only fails against the
activation) must not take the engine down: the call that gave it raises `EditFailed` naming the
edit, the point and the original error; no hook is left; the engine's next plain `generate` gives
the same tokens as before the fault and as Hugging Face's greedy generate on the same checkpoint;
requests of the same batch that the edit does not reach are untouched. At a point d_model wide, a
value that does not fit is refused before any work instead.

Without the guard (edits.py `RequestEdits._apply`), the error leaves the in-process engine's
scheduler unable to run the next request (its next `generate` waits forever), and in vLLM's
default layout ends the engine core (vLLM's EngineDeadError on that call and every one after): both
seen on main before the guard, 2026-12-08.
"""

from __future__ import annotations

import pytest
import torch
from gate import need

need("vllm")

from vllm_models import hf_model  # noqa: E402

import hookscope as hs  # noqa: E402
from hookscope.engines import vllm as hv  # noqa: E402

LENGTHS = (5, 17, 40, 90)
NEW = 5


@pytest.fixture(scope="module")
def llama(edit_llama):
    """The shared in-process llama (vllm_shared.start_edit_llama): 64 tokens per forward, so the
    90-token prompt prefills over several forwards beside the others' decode steps."""
    return edit_llama.llm, hf_model(edit_llama.directory)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(12)
    return [torch.randint(1, 250, (n,), generator=g).tolist() for n in LENGTHS]


def plain_tokens(llm, ps) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=NEW, temperature=0.0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def hf_tokens(hf, ps) -> list[list[int]]:
    """Hugging Face's greedy tokens, each prompt alone (the reference a fresh engine equals)."""
    with torch.no_grad():
        return [
            hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False)[0, len(p) :].tolist()
            for p in ps
        ]


def assert_engine_as_new(llm, hf, ps, before) -> None:
    assert llm.collective_rpc("hookscope_hook_count") == [0], "a hook was left after the fault"
    after = plain_tokens(llm, ps)
    assert after == before, "the engine generates otherwise after the fault"
    assert after == hf_tokens(hf, ps), "the engine's plain generate differs from Hugging Face's"


def test_a_steer_that_fails_in_the_forward_raises_on_the_caller_and_the_engine_runs_on(llama):
    llm, hf = llama
    ps = prompts()
    before = plain_tokens(llm, ps)
    # 3 heads' vectors for a point of 4: refused nowhere before the engine runs
    bad = hs.steer("blocks.0.attn.z", torch.randn(3, 64))
    with pytest.raises(hs.EditFailed) as caught:
        hs.generate(llm, ps, "blocks.1.resid_post", edits=[[bad], [], [], []], max_new_tokens=NEW)
    message = str(caught.value)
    assert "hs.steer('blocks.0.attn.z', vector of shape [3, 64]" in message
    assert "at blocks.0.attn.z on request 0" in message
    assert "RuntimeError: The size of tensor a (4) must match the size of tensor b (3)" in message
    assert_engine_as_new(llm, hf, ps, before)


def test_a_patch_of_the_wrong_heads_fails_the_collect_and_the_engine_runs_on(llama):
    llm, hf = llama
    ps = prompts()
    before = plain_tokens(llm, ps)
    bad = hs.patch("blocks.0.attn.z", torch.zeros(LENGTHS[1], 3, 64))  # the point has 4 heads
    with pytest.raises(hs.EditFailed) as caught:
        hv.collect(llm, ps, "blocks.1.resid_post", edits=[[], [bad], [], []])
    message = str(caught.value)
    assert "hs.patch('blocks.0.attn.z', source of shape [1, 17, 3, 64]" in message
    assert "on request 1: SelectionError: patch blocks.0.attn.z: source has shape" in message
    assert_engine_as_new(llm, hf, ps, before)


@pytest.mark.parametrize(
    "bad",
    [
        hs.patch("blocks.1.resid_post", torch.zeros(LENGTHS[0], 128)),
        hs.steer("blocks.0.mlp.out", torch.ones(255)),
        hs.ablate("blocks.1.attn.out", "mean", mean=torch.zeros(128)),
    ],
    ids=["patch", "steer", "ablate-mean"],
)
def test_a_value_that_does_not_fit_a_d_model_wide_point_is_refused_before_any_work(llama, bad):
    llm, hf = llama
    with pytest.raises(hs.EngineError, match="d_model = 256 wide: give it 256") as caught:
        hv.collect(llm, prompts()[:1], "blocks.1.resid_post", edits=[bad])
    assert type(caught.value) is hs.EngineError  # refused at the caller, not failed in the engine
    assert llm.collective_rpc("hookscope_hook_count") == [0]


def test_a_block_edit_that_fails_on_some_requests_leaves_the_others_and_raises_at_its_end(llama):
    llm, hf = llama
    ps = prompts()
    before = plain_tokens(llm, ps)
    # position 30 only: the 40- and 90-token prompts reach it, where the 3 heads' source fails;
    # the 5- and 17-token ones never do (their edit writes nothing)
    bad = hs.patch("blocks.0.attn.z", torch.zeros(40, 3, 64), positions=[30])
    with pytest.raises(hs.EditFailed) as caught, hs.edit(llm, bad):
        inside = plain_tokens(llm, ps)
    message = str(caught.value)
    assert "hs.patch('blocks.0.attn.z', source of shape [1, 40, 3, 64]" in message
    assert "SelectionError" in message and "(and 1 more such faults)" in message
    # every request ran on, the faulted ones without their edit: all as the plain engine's
    assert inside == before
    assert_engine_as_new(llm, hf, ps, before)
