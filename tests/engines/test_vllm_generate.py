"""hs.generate on a vLLM engine: requests of different lengths submitted together (the long ones
prefill in chunks while the short ones decode) each get the tokens and the captured rows, prefill and
decode, that hookscope's Hugging Face hs.generate gives that prompt alone on the same checkpoint; an
edit (steer, ablate heads, patch) changes its own request exactly as on Hugging Face and leaves the
other requests of the batch as they are alone; what the engine path refuses, before any work.

Tolerance: float32, 1e-5 of the reference's largest value (vllm_models.assert_close).
"""

from __future__ import annotations

import pytest
import torch
from gate import need

need("vllm")

from vllm_models import assert_close, hf_model  # noqa: E402

import hookscope as hs  # noqa: E402

LENGTHS = (5, 17, 40, 90, 130)
POINTS = ["blocks.1.resid_post", "blocks.0.attn.z", "blocks.0.mlp.post"]
NEW = 6


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, 250, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def llama(edit_llama):
    """The shared in-process llama (vllm_shared.start_edit_llama): 64 tokens per forward, so the 90-
    and 130-token prompts prefill over several forwards, shared with the decode steps of the short
    ones; prefix caching off; the edits' descriptions cross vLLM's serializer."""
    return edit_llama.llm, hf_model(edit_llama.directory)


def hf_generate(hf, prompt: list[int], edits=(), **kwargs) -> hs.Generation:
    return hs.generate(
        hf, torch.tensor([prompt]), POINTS, edits=edits, max_new_tokens=NEW, do_sample=False, **kwargs
    )


def assert_same(got: hs.Generation, want: hs.Generation, what: str) -> None:
    assert got.sequences.tolist() == want.sequences.tolist(), what
    assert got.prompt_length == want.prompt_length
    for point in POINTS:
        assert_close(got[point], want[point], f"{what}, {point}")


def test_requests_together_equal_hugging_face_alone(llama):
    llm, hf = llama
    together = hs.generate(llm, prompts(), POINTS, max_new_tokens=NEW)
    assert len(together) == len(LENGTHS)
    for prompt, got in zip(prompts(), together, strict=True):
        assert got.sequences.shape == (1, len(prompt) + NEW)
        assert got["blocks.0.attn.z"].shape == (1, len(prompt) + NEW, 4, 64)
        assert_same(got, hf_generate(hf, prompt), f"{len(prompt)} tokens")


def test_a_stop_token_ends_a_request_with_its_row(llama):
    """A request that stops on a stop token before max_new_tokens: the engine never ran that token,
    hs.generate runs it after, as Hugging Face's hs.generate does (its EOS row)."""
    llm, hf = llama
    prompt = prompts()[1]
    (free,) = hs.generate(llm, [prompt], max_new_tokens=NEW)
    stop = int(free.new_tokens[0, 2])
    assert stop not in free.new_tokens[0, :2].tolist()  # the third token is the first of its kind
    (got,) = hs.generate(llm, [prompt], POINTS, max_new_tokens=NEW, stop_token_ids=[stop])
    assert got.new_tokens.shape[1] == 3
    assert_same(got, hf_generate(hf, prompt, eos_token_id=stop), "stopped")


def edits_per_request(prompt_of_patch: list[int]):
    vector = torch.randn(256, generator=torch.Generator().manual_seed(5))
    source = torch.randn(len(prompt_of_patch), 256, generator=torch.Generator().manual_seed(6))
    steer = hs.steer("blocks.0.resid_post", vector, scale=3.0)
    ablate = hs.ablate("blocks.0.attn.z", heads=[1, 2])
    # the engine's patch source is the request's own rows, [tokens, d]; Hugging Face's [1, tokens, d].
    # resid_mid: the stream both the MLP and the skip connection read, written so on both sides
    patch = (hs.patch("blocks.1.resid_mid", source, positions=[1, 3]), source[None])
    return steer, ablate, patch


def test_edits_change_their_own_request_only(llama):
    llm, hf = llama
    ps = prompts()
    steer, ablate, (patch, hf_source) = edits_per_request(ps[4])
    edits = [[steer], [], [ablate], [], [patch]]
    mixed = hs.generate(llm, ps, POINTS, edits=edits, max_new_tokens=NEW)
    hf_patch = hs.patch("blocks.1.resid_mid", hf_source, positions=[1, 3])
    for i, hf_edits in ((0, [steer]), (2, [ablate]), (4, [hf_patch])):
        want = hf_generate(hf, ps[i], hf_edits)
        assert_same(mixed[i], want, f"request {i}, edited")
        plain = hf_generate(hf, ps[i])
        moved = (want["blocks.1.resid_post"] - plain["blocks.1.resid_post"]).abs().max()
        assert moved > 1e-3, f"request {i}: the edit changed nothing, the test cannot tell"
    for i in (1, 3):
        (alone,) = hs.generate(llm, [ps[i]], POINTS, max_new_tokens=NEW)
        assert_same(mixed[i], alone, f"request {i}, unedited, vs alone")


def test_an_edit_for_every_prompt_and_edit_on(llama):
    """A flat edits= list reaches every prompt; edit_on='generated' leaves the prompt's rows alone."""
    llm, hf = llama
    ps = prompts()[:2]
    steer, _, _ = edits_per_request(ps[0])
    got = hs.generate(llm, ps, POINTS, edits=[steer], edit_on="generated", max_new_tokens=NEW)
    for prompt, gen in zip(ps, got, strict=True):
        assert_same(gen, hf_generate(hf, prompt, [steer], edit_on="generated"), f"{len(prompt)}, generated")


def test_an_edit_at_one_generated_position_lands_on_that_step_only(llama):
    """An edit that follows positions (one generated position per request) is decided anew on every
    decode step, though each step holds the same requests at the same rows as the one before (where
    the worker keeps the decisions of edits that do not follow positions)."""
    llm, hf = llama
    ps = prompts()[:2]
    edits = [[hs.ablate("blocks.0.resid_post", positions=[len(p) + 2])] for p in ps]
    got = hs.generate(llm, ps, POINTS, edits=edits, max_new_tokens=NEW)
    for prompt, gen, one in zip(ps, got, edits, strict=True):
        want = hf_generate(hf, prompt, one)
        assert_same(gen, want, f"{len(prompt)} tokens, ablated at position {len(prompt) + 2}")
        moved = (want["blocks.1.resid_post"] - hf_generate(hf, prompt)["blocks.1.resid_post"]).abs().max()
        assert moved > 1e-3, "the ablation changed nothing: the test cannot tell"


@pytest.mark.parametrize(
    "options, match",
    [
        ({"n": 2}, "takes n=1"),
        ({"best_of": 2}, "best_of"),
        ({"num_beams": 4}, "beam search"),
        ({"use_beam_search": True}, "beam search"),
        ({"do_sample": False}, "takes no do_sample"),
        ({"max_tokens": 4}, "takes no max_tokens"),
        ({"skip_clone": False}, "takes no skip_clone"),  # hs.generate makes each request's params alone
        ({"edits": [[], []]}, "2 lists for 1 prompts"),
    ],
)
def test_options_the_engine_path_cannot_take_are_refused(llama, options, match):
    llm, _ = llama
    with pytest.raises(hs.EngineError, match=match):
        hs.generate(llm, prompts()[:1], POINTS, max_new_tokens=2, **options)


def test_edits_the_engine_cannot_apply_are_refused(llama):
    llm, _ = llama
    with pytest.raises(hs.EngineError, match="d_model = 256 wide"):
        hs.generate(llm, prompts()[:1], edits=[hs.steer("blocks.0.resid_post", torch.ones(8))])
    with pytest.raises(hs.EngineError, match="position 7 is to be patched"):
        hs.generate(
            llm, prompts()[:1], edits=[hs.patch("blocks.0.mlp.out", torch.ones(5, 256), positions=[2, 7])]
        )
    with pytest.raises(hs.EngineError, match="cannot be written"):
        hs.generate(llm, prompts()[:1], edits=[hs.ablate("blocks.0.ln2.normalized")])
    with pytest.raises(hs.EngineError, match="give the mean to write"):
        hs.generate(llm, prompts()[:1], edits=[hs.ablate("blocks.0.mlp.out", "mean")])
    with pytest.raises(hs.SelectionError, match="counts from the end"):
        hs.generate(llm, prompts()[:1], edits=[hs.ablate("blocks.0.mlp.out", positions="last")])
    assert llm.collective_rpc("hookscope_hook_count") == [0]  # nothing was attached


def test_collect_with_edits_per_prompt(llama):
    """The engine's prefill capture takes edits too: an ablation on one prompt of two."""
    from hookscope.engines import vllm as hv

    llm, hf = llama
    ps = prompts()[1:3]
    ablate = hs.ablate("blocks.0.attn.z", heads=[0, 3])
    got = hv.collect(llm, ps, "blocks.1.resid_post", edits=[[], [ablate]])
    plain = hs.collect(hf, torch.tensor([ps[0]]), "blocks.1.resid_post")["blocks.1.resid_post"][0]
    with hs.edit(hf, ablate):
        edited = hs.collect(hf, torch.tensor([ps[1]]), "blocks.1.resid_post")["blocks.1.resid_post"][0]
    assert_close(got[0]["blocks.1.resid_post"], plain, "unedited prompt")
    assert_close(got[1]["blocks.1.resid_post"], edited, "ablated prompt")


def test_edits_are_refused_under_prefix_caching():
    from test_vllm_requests import fake_llm

    from hookscope.engines import vllm as hv

    llm = fake_llm()
    llm.llm_engine.vllm_config.cache_config = type("Cache", (), {"enable_prefix_caching": True})()
    arch = hv.tables.table("LlamaForCausalLM", _config())
    with pytest.raises(hs.EngineError, match="enable_prefix_caching=False"):
        hv.describe_edits(llm, arch, [hs.ablate("blocks.0.attn.z")], 1)


def _config():
    from transformers import AutoConfig

    return AutoConfig.for_model("llama", hidden_size=256, num_attention_heads=4, num_hidden_layers=2)
