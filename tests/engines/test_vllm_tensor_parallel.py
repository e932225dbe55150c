"""A tensor-parallel vLLM engine (tensor_parallel_size=2 on the CPU backend, vLLM's default
process layout: the engine core and one worker process per rank) captures every point equal to
the same checkpoint on one rank and to hookscope's Hugging Face capture (float32, to 1e-5 of the
reference's largest value: the ranks' all-reduce sums in another order).

The points vLLM splits across the ranks (q / k / v from qkv_proj, mlp.pre / mlp.pre_linear from
gate_up_proj, attn.z and mlp.post, the inputs of the row-parallel o_proj / down_proj) come back
whole: each rank reads its slice through the table's per-rank view and the rows are all-gathered.

vLLM's CPU workers bind their threads one NUMA node per rank unless told which CPUs to use:
on a one-node machine, VLLM_CPU_OMP_THREADS_BIND gives each rank its own CPU ("0|1").
"""

from __future__ import annotations

import pytest
import torch
from gate import need

need("vllm")

from vllm_models import assert_close, engine, hf_model, save, shut  # noqa: E402

import hookscope as hs  # noqa: E402
from hookscope.engines import vllm as hv  # noqa: E402

pytestmark = pytest.mark.slow  # two engine starts, one of them three processes

PROMPTS = [[3, 17, 250, 9, 41], list(range(20, 57))]
SPLIT = ("attn.q", "attn.k", "attn.v", "attn.z", "mlp.pre", "mlp.pre_linear", "mlp.post")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save("llama", tmp_path_factory.mktemp("llama-tp"))


@pytest.fixture(scope="module")
def one_rank(checkpoint):
    """Every point on one rank, in vLLM's default layout too (an engine core in this process would
    freeze vLLM's environment settings here, the two-rank engine's thread binding with them)."""
    llm = engine(checkpoint)
    try:
        names = [p.name for p in hs.points(llm)]
        yield names, hs.collect(llm, PROMPTS, names)
    finally:
        shut(llm)


@pytest.fixture(scope="module")
def two_ranks(checkpoint, one_rank):
    from vllm import envs

    # an engine core run in this process before (test_vllm_names.py's) froze vLLM's settings there
    envs.disable_envs_cache()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        llm = engine(checkpoint, tensor_parallel_size=2, enable_prefix_caching=False)
        yield llm
        shut(llm)


def test_every_point_equals_one_rank_and_hugging_face(checkpoint, one_rank, two_ranks):
    names, want = one_rank
    assert any(n.endswith(SPLIT) for n in names)
    got = hs.collect(two_ranks, PROMPTS, names)
    hf = hf_model(checkpoint)
    for i, prompt in enumerate(PROMPTS):
        reference = hs.collect(hf, torch.tensor([prompt]), names)
        for name in names:
            what = f"TP=2 {name} ({len(prompt)} tokens)"
            assert_close(got[i][name], want[i][name], f"{what} against TP=1")
            assert_close(got[i][name], reference[name][0], f"{what} against Hugging Face")


def test_no_hook_is_left_on_either_rank(two_ranks):
    """Two worker ranks answer, and each removed its capture's hooks."""
    hs.collect(two_ranks, PROMPTS[:1], ["blocks.0.attn.q", "blocks.1.mlp.post"])
    assert two_ranks.collective_rpc("hookscope_hook_count") == [0, 0]


def test_steering_a_split_point_is_refused_by_name(two_ranks):
    with pytest.raises(Exception, match="tensor-parallel engine, whose ranks each hold a slice"):
        hv.register_vector(two_ranks, "z", "blocks.0.mlp.post", torch.ones(512))


def test_an_edit_at_a_split_point_is_refused_before_any_hook(two_ranks):
    """Global head indices on a rank's slice of the heads would ablate the wrong heads: refused, and
    neither rank is left holding a hook."""
    with pytest.raises(Exception, match="edits at blocks.0.attn.z on a tensor-parallel engine"):
        hs.generate(two_ranks, PROMPTS[:1], edits=[hs.ablate("blocks.0.attn.z", heads=[3])], max_new_tokens=2)
    assert two_ranks.collective_rpc("hookscope_hook_count") == [0, 0]


def test_an_edit_block_reaches_both_ranks(checkpoint, two_ranks):
    """`with hs.edit(llm, ...)` on two ranks: a steering vector on the residual stream (whole on every
    rank) equals Hugging Face's hs.edit, prefill and decode; a point each rank holds a slice of is
    refused by name; neither rank keeps a hook after either block."""
    steer = hs.steer(
        "blocks.0.resid_post", torch.randn(256, generator=torch.Generator().manual_seed(3)), scale=3
    )
    points = ["blocks.1.resid_post", "blocks.1.attn.z"]
    with hs.edit(two_ranks, steer):
        got = hs.collect(two_ranks, PROMPTS, points)
        gens = hs.generate(two_ranks, PROMPTS, max_new_tokens=4)
    hf = hf_model(checkpoint)
    for i, prompt in enumerate(PROMPTS):
        with hs.edit(hf, steer):
            want = hs.collect(hf, torch.tensor([prompt]), points)
            want_gen = hs.generate(hf, torch.tensor([prompt]), max_new_tokens=4, do_sample=False)
        for name in points:
            assert_close(got[i][name], want[name][0], f"TP=2 in hs.edit, {name} ({len(prompt)} tokens)")
        assert gens[i].sequences.tolist() == want_gen.sequences.tolist()
    assert two_ranks.collective_rpc("hookscope_hook_count") == [0, 0]
    with pytest.raises(hs.EngineError, match="edits at blocks.0.attn.z on a tensor-parallel engine"):
        with hs.edit(two_ranks, hs.ablate("blocks.0.attn.z", heads=[3])):
            pass
    assert two_ranks.collective_rpc("hookscope_hook_count") == [0, 0]
