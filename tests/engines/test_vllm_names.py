"""Every point of hookscope's vLLM tables, on every family they cover, equal to hookscope's Hugging
Face capture of the same saved checkpoint (float32, to 1e-5 of the reference's largest value): the
residual stream with vLLM's deferred add put back, q / k / v split from the fused qkv_proj, the
gate / up halves of gate_up_proj, the norms' normalized inputs computed on the fused sum; under
vLLM's prefix caching (on by default, as on these engines) a capture still computes a prompt seen
before whole.

One engine per family (module-scoped) with the engine core in this process (vllm_models.IN_PROCESS:
an engine starts in ~3 s instead of ~15 s, which keeps the vllm environment's run short).
"""

from __future__ import annotations

import pytest
import torch
from gate import need

need("vllm")

from vllm_models import FAMILIES, assert_close, engine, hf_model, save, shut  # noqa: E402

import hookscope as hs  # noqa: E402
from hookscope.arch import arch_of  # noqa: E402
from hookscope.engines import vllm as hv  # noqa: E402

PROMPTS = [[3, 17, 250, 9, 41], list(range(20, 57))]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    directory = save(request.param, tmp_path_factory.mktemp(request.param))
    llm = engine(directory, in_process=True)
    yield request.param, directory, llm
    shut(llm)


def test_every_point_equals_the_hugging_face_capture(family):
    case, directory, llm = family
    names = [p.name for p in hs.points(llm)]
    assert f"blocks.{1}.resid_post" in names and "ln_final" in names
    hf = hf_model(directory)
    hf_names = set(arch_of(hf).specs)
    assert set(names) <= hf_names, f"{case}: names Hugging Face lacks: {set(names) - hf_names}"
    got = hs.collect(llm, PROMPTS, names)
    assert len(got) == len(PROMPTS)
    for prompt, rows in zip(PROMPTS, got, strict=True):
        want = hs.collect(hf, torch.tensor([prompt]), names)
        for name in names:
            assert_close(rows[name], want[name][0], f"{case} {name} ({len(prompt)} tokens)")


def test_resid_pre_of_the_next_block_is_resid_post(family):
    """The fused residual is put back at both ends of a block, not only compared to HF at one."""
    _, _, llm = family
    (rows,) = hs.collect(llm, [PROMPTS[1]], ["blocks.0.resid_post", "blocks.1.resid_pre", "embed"])
    assert torch.equal(rows["blocks.0.resid_post"], rows["blocks.1.resid_pre"])
    assert not torch.allclose(rows["blocks.0.resid_post"], rows["embed"])


def test_a_prompt_seen_before_is_computed_whole_under_prefix_caching(family):
    """The second request of the same prompt would read its blocks from vLLM's prefix cache (on by
    default, as on these engines) and skip their forward; the capture bypasses the cache for its
    requests."""
    case, _, llm = family
    assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    prompt = torch.randint(1, 250, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    first, second = hs.collect(llm, [prompt, prompt], "blocks.1.resid_post")
    (third,) = hs.collect(llm, [prompt], "blocks.1.resid_post")
    for rows in (second, third):
        assert rows["blocks.1.resid_post"].shape[0] == len(prompt)
        assert_close(rows["blocks.1.resid_post"], first["blocks.1.resid_post"], f"{case}, cached prompt")


def test_a_point_vllm_never_exposes_is_refused_by_name(family):
    _, _, llm = family
    with pytest.raises(hs.UnknownPointError, match="never materialise the attention weights"):
        hs.collect(llm, PROMPTS, "blocks.0.attn.pattern")
    with pytest.raises(hs.UnknownPointError, match="ln_final"):
        hs.collect(llm, PROMPTS, "logits")


def test_an_unknown_point_lists_close_names(family):
    _, _, llm = family
    with pytest.raises(hs.UnknownPointError, match=r"closest: blocks\.1\.resid_post"):
        hs.collect(llm, PROMPTS, "blocks.1.resid_psot")
    with pytest.raises(hs.UnknownPointError, match="blocks 0-1"):
        hs.collect(llm, PROMPTS, "blocks.7.resid_post")


def test_an_architecture_without_a_table_is_refused_with_the_reason():
    with pytest.raises(hs.EngineError, match="Transformers backend"):
        hv.tables.table("GPTNeoXForCausalLM", None)


@pytest.fixture(scope="module")
def gpt2_for_edits(tmp_path_factory):
    """GPT-2 keeps its residual inside the block, as Hugging Face's does; edits refuse prefix caching."""
    directory = save("gpt2", tmp_path_factory.mktemp("gpt2-edits"))
    llm = engine(directory, in_process=True, enable_prefix_caching=False)
    yield directory, llm
    shut(llm)


def test_a_steer_at_resid_mid_writes_the_residual_stream(gpt2_for_edits):
    """TransformerLens's resid_mid is the stream both the MLP and the skip connection read: a steer
    there equals adding the vector to the attention's output (resid_mid = resid_pre + attn.out), a
    plain hook on the Hugging Face block's attention module."""
    directory, llm = gpt2_for_edits
    hf = hf_model(directory)
    vector = torch.randn(hf.config.n_embd, generator=torch.Generator().manual_seed(0))
    points = ["blocks.0.resid_post", "blocks.1.resid_post"]
    got = hv.collect(llm, PROMPTS, points, edits=[hs.steer("blocks.0.resid_mid", vector, scale=2.0)])

    def add(module, args, output):
        return (output[0] + 2.0 * vector, *output[1:]) if isinstance(output, tuple) else output + 2.0 * vector

    handle = hf.transformer.h[0].attn.register_forward_hook(add)
    try:
        for prompt, rows in zip(PROMPTS, got, strict=True):
            want = hs.collect(hf, torch.tensor([prompt]), points)
            for name in points:
                assert_close(rows[name], want[name][0], f"gpt2 steered {name} ({len(prompt)} tokens)")
    finally:
        handle.remove()
