"""A tensor-parallel vLLM engine (tensor_parallel_size=2 on the CPU backend, vLLM's default
process layout: the engine core and one worker process per rank) captures every point equal to
the same checkpoint on one rank and to hookscope's Hugging Face capture (float32, to 1e-5 of the
reference's largest value: the ranks' all-reduce sums in another order).

The points vLLM splits across the ranks (q / k / v from qkv_proj, mlp.pre / mlp.pre_linear from
gate_up_proj, attn.z and mlp.post, the inputs of the row-parallel o_proj / down_proj) come back
whole: each rank reads its slice through the table's per-rank view and the rows are all-gathered.
An edit there is given for the whole point (a vector of all heads / all neurons, global head
indices, a patch source of the whole point) and each rank writes its part: tokens and captures
equal Hugging Face's hs.generate with the same edit on the same checkpoint.

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
POINTS = ["blocks.0.attn.z", "blocks.0.mlp.post", "blocks.1.attn.k", "blocks.1.resid_post"]
NEW = 4


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


@pytest.fixture(scope="module")
def hf(checkpoint):
    return hf_model(checkpoint)


def test_every_point_equals_one_rank_and_hugging_face(one_rank, two_ranks, hf):
    names, want = one_rank
    assert any(n.endswith(SPLIT) for n in names)
    got = hs.collect(two_ranks, PROMPTS, names)
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


def hf_generate(hf, prompt, edits):
    return hs.generate(hf, torch.tensor([prompt]), POINTS, edits=edits, max_new_tokens=NEW, do_sample=False)


def assert_same(got: hs.Generation, want: hs.Generation, what: str) -> None:
    assert got.sequences.tolist() == want.sequences.tolist(), f"{what}: tokens"
    for point in POINTS:
        assert_close(got[point], want[point], f"{what}, {point}")


def _vector(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# global heads 0-1 are rank 0's, 2-3 rank 1's; the k / v heads (2 of them) one per rank
WHOLE_POINT_EDITS = {
    "steer attn.z, every head": lambda: hs.steer("blocks.0.attn.z", _vector(4, 64, seed=1), scale=2),
    "steer mlp.post, every neuron": lambda: hs.steer("blocks.0.mlp.post", _vector(512, seed=2), scale=2),
    "steer attn.z, one head broadcast": lambda: hs.steer("blocks.1.attn.z", _vector(64, seed=3), scale=3),
    "steer attn.k": lambda: hs.steer("blocks.0.attn.k", _vector(2, 64, seed=4), scale=3),
    "ablate attn.z heads 1 and 3 (one on each rank)": lambda: hs.ablate("blocks.0.attn.z", heads=[1, 3]),
    "ablate attn.z head 2 (rank 1's alone)": lambda: hs.ablate("blocks.0.attn.z", heads=[2]),
    "mean-ablate attn.z heads 0 and -1": lambda: hs.ablate(
        "blocks.0.attn.z", "mean", heads=[0, -1], mean=_vector(4, 64, seed=5)
    ),
}


@pytest.mark.parametrize("case", list(WHOLE_POINT_EDITS))
def test_a_whole_point_edit_at_a_split_point_equals_hugging_face(checkpoint, two_ranks, hf, case):
    edit = WHOLE_POINT_EDITS[case]()
    got = hs.generate(two_ranks, PROMPTS, POINTS, edits=[edit], max_new_tokens=NEW)
    for prompt, one in zip(PROMPTS, got, strict=True):
        want = hf_generate(hf, prompt, [edit])
        plain = hf_generate(hf, prompt, [])["blocks.1.resid_post"]
        assert (want["blocks.1.resid_post"] - plain).abs().max() > 1e-3, f"{case}: the edit changes nothing"
        assert_same(one, want, f"TP=2 {case} ({len(prompt)} tokens)")
    assert two_ranks.collective_rpc("hookscope_hook_count") == [0, 0]


def test_a_patch_at_q_takes_each_ranks_heads_of_the_source(two_ranks, hf):
    """Heads 1 and 2 of another prompt's q (one on each rank) written at positions 1-3."""
    prompt, other = PROMPTS[0], [7, 300, 11, 64, 90]
    source = hs.collect(hf, torch.tensor([other]), "blocks.0.attn.q")["blocks.0.attn.q"]
    edit = hs.patch("blocks.0.attn.q", source[0], heads=[1, 2], positions=[1, 2, 3])
    (got,) = hs.generate(two_ranks, [prompt], POINTS + ["blocks.0.attn.q"], edits=[edit], max_new_tokens=NEW)
    want = hs.generate(
        hf,
        torch.tensor([prompt]),
        POINTS + ["blocks.0.attn.q"],
        edits=[hs.patch("blocks.0.attn.q", source, heads=[1, 2], positions=[1, 2, 3])],
        max_new_tokens=NEW,
        do_sample=False,
    )
    assert_same(got, want, "TP=2 patch at q")
    assert_close(got["blocks.0.attn.q"][0, 1:4, 1:3], source[0, 1:4, 1:3], "the patched heads")


def test_a_vector_that_fits_no_whole_point_is_refused_before_any_hook(two_ranks):
    with pytest.raises(hs.EngineError, match=r"shape \(300,\).*whole point .* is \(512,\)"):
        hs.generate(
            two_ranks, PROMPTS[:1], edits=[hs.steer("blocks.0.mlp.post", torch.ones(300))], max_new_tokens=2
        )
    with pytest.raises(hs.EngineError, match=r"heads \[4\] at blocks.0.attn.z, which has 4 heads"):
        hs.generate(two_ranks, PROMPTS[:1], edits=[hs.ablate("blocks.0.attn.z", heads=[4])], max_new_tokens=2)
    assert two_ranks.collective_rpc("hookscope_hook_count") == [0, 0]


def test_an_edit_block_reaches_both_ranks(checkpoint, two_ranks, hf):
    """`with hs.edit(llm, ...)` on two ranks: a steering vector on the residual stream (whole on every
    rank) and a head ablation at attn.z (each rank its heads) equal Hugging Face's hs.edit, prefill and
    decode; neither rank keeps a hook after the block."""
    steer = hs.steer("blocks.0.resid_post", _vector(256, seed=3), scale=3)
    ablate = hs.ablate("blocks.1.attn.z", heads=[3])
    points = ["blocks.1.resid_post", "blocks.1.attn.z"]
    with hs.edit(two_ranks, steer, ablate):
        got = hs.collect(two_ranks, PROMPTS, points)
        gens = hs.generate(two_ranks, PROMPTS, max_new_tokens=4)
    for i, prompt in enumerate(PROMPTS):
        with hs.edit(hf, steer, ablate):
            want = hs.collect(hf, torch.tensor([prompt]), points)
            want_gen = hs.generate(hf, torch.tensor([prompt]), max_new_tokens=4, do_sample=False)
        for name in points:
            assert_close(got[i][name], want[name][0], f"TP=2 in hs.edit, {name} ({len(prompt)} tokens)")
        assert gens[i].sequences.tolist() == want_gen.sequences.tolist()
        assert (got[i]["blocks.1.attn.z"][:, 3] == 0).all()
    assert two_ranks.collective_rpc("hookscope_hook_count") == [0, 0]


def test_a_named_vector_at_a_split_point_steers_each_rank(two_ranks, hf):
    """`vllm serve`'s named edits take the same path: a registered mlp.post vector (all neurons).
    Last in the module: a named vector stays registered, its hook with it."""
    vector = _vector(512, seed=6)
    hv.register_vector(two_ranks, "post", "blocks.0.mlp.post", vector)
    params = hv.sampling_params(steer=(("post", 2.0),), max_tokens=NEW, temperature=0)
    (out,) = two_ranks.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)
    want = hf_generate(hf, PROMPTS[1], [hs.steer("blocks.0.mlp.post", vector, scale=2)])
    assert want.sequences.tolist() != hf_generate(hf, PROMPTS[1], []).sequences.tolist()  # (it steers)
    assert list(out.outputs[0].token_ids) == want.sequences[0, len(PROMPTS[1]) :].tolist()
