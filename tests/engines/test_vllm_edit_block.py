"""`with hs.edit(llm, ...)` on a vLLM engine: the block's edits reach every request the engine runs
inside it (`hs.generate`, `hs.collect` and the engine's own `llm.generate`) on every prefill and
decode token, equal to the same edits given to each call (`edits=`, tested in
test_vllm_generate.py) and to Hugging Face's `hs.edit` on the same checkpoint; nested blocks and a
call's `edits=` apply in Hugging Face's order; after the block, also when its body raises, no worker
keeps an edit or a hook; bad edits are refused before any worker is called.

Tolerance: float32, 1e-5 of the reference's largest value (vllm_models.assert_close); token ids
exactly; the engine's logprobs against Hugging Face's log-softmax to 1e-4 (their sums of ~500
exponentials in another order).
"""

from __future__ import annotations

import pytest
import torch
from gate import need

need("vllm")

from vllm_models import assert_close, hf_model  # noqa: E402

import hookscope as hs  # noqa: E402
from hookscope.engines import vllm as hv  # noqa: E402

LENGTHS = (5, 17, 40, 90)
POINTS = ["blocks.1.resid_post", "blocks.0.attn.z"]
NEW = 6


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, 250, (n,), generator=g).tolist() for n in LENGTHS]


def vector(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


STEER = hs.steer("blocks.1.resid_post", vector(256, seed=5), scale=3.0)
ABLATE = hs.ablate("blocks.0.attn.z", heads=[1])
# two edits at one point whose order shows: a head zeroed after the steer stays zero, before it
# holds the steer's values
STEER_Z = hs.steer("blocks.0.attn.z", vector(4, 64, seed=6), scale=2.0)
ABLATE_Z = hs.ablate("blocks.0.attn.z", heads=[2])


@pytest.fixture(scope="module")
def llama(edit_llama):
    """The shared in-process llama (vllm_shared.start_edit_llama): 64 tokens per forward, so the
    90-token prompt prefills over several forwards, beside the decode steps of the short ones;
    prefix caching off; the block's edits cross vLLM's serializer."""
    return edit_llama.directory, edit_llama.llm, hf_model(edit_llama.directory)


def greedy(**more):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=0, detokenize=False, **more)


def plain_generate(llm, ps):
    """The engine's own `generate`, no hookscope argument: (token ids, logprob of each) per prompt."""
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], greedy(), use_tqdm=False)
    return [
        (
            list(o.outputs[0].token_ids),
            torch.tensor([next(iter(step.values())).logprob for step in o.outputs[0].logprobs]),
        )
        for o in outs
    ]


def hf_generate(hf, prompt, blocks=(), edits=()) -> hs.Generation:
    """Hugging Face's hs.generate inside nested hs.edit blocks (one tuple of edits per block)."""
    import contextlib

    with contextlib.ExitStack() as stack:
        for block in blocks:
            stack.enter_context(hs.edit(hf, *block))
        return hs.generate(
            hf, torch.tensor([prompt]), POINTS, edits=list(edits), max_new_tokens=NEW, do_sample=False
        )


def assert_same(got: hs.Generation, want: hs.Generation, what: str) -> None:
    assert got.sequences.tolist() == want.sequences.tolist(), what
    for point in POINTS:
        assert_close(got[point], want[point], f"{what}, {point}")


def assert_no_edit_left(llm, ps, before) -> None:
    assert llm.collective_rpc("hookscope_hook_count") == [0]
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(plain_generate(llm, ps), before, strict=True):
        assert tokens == want_tokens
        assert torch.equal(logprobs, want_logprobs)


# First in the file: it runs on the default-layout engine test_vllm_selections.py leaves up (the
# files run next to each other), before the shared in-process llama is started for the rest
def test_in_vllms_default_layout(default_layout_llama):
    """The engine core and its worker in their own processes: the block reaches the worker there,
    and leaves nothing when it ends."""
    llm, hf = default_layout_llama.llm, hf_model(default_layout_llama.directory)
    ps = prompts()[:2]
    before = plain_generate(llm, ps)
    with hs.edit(llm, STEER, ABLATE):
        own = plain_generate(llm, ps)
    for prompt, (tokens, _) in zip(ps, own, strict=True):
        assert prompt + tokens == hf_generate(hf, prompt, blocks=[(STEER, ABLATE)]).sequences[0].tolist()
    assert_no_edit_left(llm, ps, before)


def test_the_block_reaches_every_call_and_equals_edits_given_per_call_and_hugging_face(llama):
    _, llm, hf = llama
    ps = prompts()
    before = plain_generate(llm, ps)
    with hs.edit(llm, STEER, ABLATE):
        gens = hs.generate(llm, ps, POINTS, max_new_tokens=NEW)
        rows = hs.collect(llm, ps, POINTS)
        own = plain_generate(llm, ps)
    per_call = hs.generate(llm, ps, POINTS, edits=[STEER, ABLATE], max_new_tokens=NEW)
    per_call_rows = hv.collect(llm, ps, POINTS, edits=[STEER, ABLATE])
    for i, prompt in enumerate(ps):
        what = f"{len(prompt)} tokens"
        assert_same(gens[i], per_call[i], f"{what}: the block against edits=")
        want = hf_generate(hf, prompt, blocks=[(STEER, ABLATE)])
        assert_same(gens[i], want, f"{what}: the block against Hugging Face's hs.edit")
        moved = (want["blocks.1.resid_post"] - hf_generate(hf, prompt)["blocks.1.resid_post"]).abs().max()
        assert moved > 1e-3, f"{what}: the edits changed nothing, the test cannot tell"
        for point in POINTS:
            assert_close(
                rows[i][point], per_call_rows[i][point], f"{what}, hs.collect {point} against edits="
            )
            assert_close(
                rows[i][point], want[point][0, : len(prompt)], f"{what}, hs.collect {point} against HF"
            )
        # the engine's own generate, untagged, is edited on every token: its tokens are hs.generate's,
        # and each one's logprob is Hugging Face's under hs.edit on the prompt and the tokens before it
        tokens, logprobs = own[i]
        assert tokens == gens[i].new_tokens[0].tolist(), what
        assert not torch.allclose(logprobs, before[i][1]), f"{what}: the engine's own generate was not edited"
        ids = torch.tensor([prompt + tokens[:-1]])
        with torch.no_grad(), hs.edit(hf, STEER, ABLATE):
            logits = hf(ids).logits[0, len(prompt) - 1 :]
        want_logprobs = logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert_close(logprobs, want_logprobs, f"{what}: the engine's own generate's logprobs", rel=1e-4)
    assert_no_edit_left(llm, ps, before)


def test_nested_blocks_and_edits_given_inside_apply_in_hugging_faces_order(llama):
    _, llm, hf = llama
    ps = prompts()[:3]
    before = plain_generate(llm, ps)
    with hs.edit(llm, STEER_Z):
        with hs.edit(llm, ABLATE_Z, STEER):
            both = hs.generate(llm, ps, POINTS, max_new_tokens=NEW)
        outer = hs.generate(llm, ps, POINTS, max_new_tokens=NEW)
        on_top = hs.generate(llm, ps, POINTS, edits=[ABLATE_Z], max_new_tokens=NEW)
    for i, prompt in enumerate(ps):
        what = f"{len(prompt)} tokens"
        want_both = hf_generate(hf, prompt, blocks=[(STEER_Z,), (ABLATE_Z, STEER)])
        assert_same(both[i], want_both, f"{what}, nested")
        z = both[i]["blocks.0.attn.z"][0]
        assert z[:, 2].abs().max() == 0, "the inner block's ablation ran before the outer block's steer"
        assert z[:, 0].abs().max() > 0
        assert_same(outer[i], hf_generate(hf, prompt, blocks=[(STEER_Z,)]), f"{what}, the outer block left")
        assert_same(on_top[i], hf_generate(hf, prompt, [(STEER_Z,)], [ABLATE_Z]), f"{what}, edits= on top")
        assert on_top[i]["blocks.0.attn.z"][0, :, 2].abs().max() == 0
        assert_same(
            on_top[i],
            hs.generate(llm, [prompt], POINTS, edits=[STEER_Z, ABLATE_Z], max_new_tokens=NEW)[0],
            what,
        )
    assert_no_edit_left(llm, ps, before)


def test_an_error_inside_the_block_leaves_no_edit_behind(llama):
    _, llm, _ = llama
    ps = prompts()[:2]
    before = plain_generate(llm, ps)
    with pytest.raises(RuntimeError, match="the body failed"), hs.edit(llm, STEER, ABLATE):
        edited = plain_generate(llm, ps)
        raise RuntimeError("the body failed")
    assert [t for t, _ in edited] != [t for t, _ in before]
    assert_no_edit_left(llm, ps, before)
    # a call that fails inside the block (refused by the engine path) leaves nothing either
    with pytest.raises(hs.EngineError, match="takes n=1"), hs.edit(llm, STEER):
        hs.generate(llm, ps, max_new_tokens=2, n=2)
    assert_no_edit_left(llm, ps, before)


class _Twice(hs.Edit):
    def value(self, act, spec, part=None):
        return 2 * act


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (hs.steer("blocks.7.resid_post", torch.ones(256)), hs.UnknownPointError, "blocks.7.resid_post"),
        (hs.ablate("blocks.0.attn.pattern"), hs.UnknownPointError, "attention weights"),
        (hs.ablate("blocks.0.ln1.normalized"), hs.EngineError, "cannot be written on vLLM"),
        (_Twice("blocks.0.resid_post"), hs.EngineError, "_Twice edits do not run on a vLLM engine"),
        (hs.ablate("blocks.0.resid_post", "mean"), hs.EngineError, "give the mean to write"),
        (hs.steer("blocks.0.resid_post", torch.ones(255)), hs.EngineError, "d_model = 256 wide"),
        (hs.patch("blocks.0.resid_post", torch.ones(5, 256)), hs.EngineError, "name the positions"),
        (
            hs.patch("blocks.0.resid_post", torch.ones(5, 256), positions=slice(2, None)),
            hs.EngineError,
            "name the positions",
        ),
        (hs.patch("blocks.0.resid_post", torch.ones(5, 256), positions=[1, 7]), hs.EngineError, "position 7"),
        (
            hs.steer("blocks.0.resid_post", torch.ones(256), positions=[-1]),
            hs.SelectionError,
            "counts from the end",
        ),
    ],
)
def test_bad_edits_are_refused_before_any_worker_is_called(llama, monkeypatch, bad, error, match):
    _, llm, _ = llama
    calls = []
    monkeypatch.setattr(llm, "collective_rpc", lambda *a, **k: calls.append(a))
    with pytest.raises(error, match=match):
        hs.edit(llm, STEER, bad)
    assert calls == []


def test_prefix_caching_is_refused(llama, monkeypatch):
    _, llm, _ = llama
    monkeypatch.setattr(llm.llm_engine.vllm_config.cache_config, "enable_prefix_caching", True)
    with pytest.raises(hs.EngineError, match="enable_prefix_caching=False"):
        hs.edit(llm, STEER)


def test_a_patch_at_named_positions_equals_hugging_face(llama):
    """A patch in a block writes its positions of every request long enough to have them."""
    _, llm, hf = llama
    ps = prompts()
    source = vector(5, 256, seed=8)
    with hs.edit(llm, hs.patch("blocks.1.resid_mid", source, positions=[1, 3])):
        rows = hs.collect(llm, ps, POINTS)
    for i, prompt in enumerate(ps):
        hf_source = torch.zeros(1, len(prompt), 256)
        hf_source[0, :5] = source
        with hs.edit(hf, hs.patch("blocks.1.resid_mid", hf_source, positions=[1, 3])):
            want = hs.collect(hf, torch.tensor([prompt]), POINTS)
        for point in POINTS:
            assert_close(rows[i][point], want[point][0], f"{len(prompt)} tokens, {point}")
