"""Mixture-of-experts families on vLLM (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): every point of
hookscope's vLLM table equal to hookscope's Hugging Face capture of the same saved checkpoint
(float32, to 1e-5 of the reference's largest value): the dense points as on Llama, the router's
logits, Qwen2-MoE's shared expert, the routed experts' sum and the MoE block's output. Every
Hugging Face MLP point the table lacks (routing weights and indices, per-expert rows, hidden
activations and outputs: inside vLLM's fused MoE kernel) is refused by name, saying why and what
to use instead. An ablation inside the MoE block equals a hand-written Hugging Face hook; a write to
the router's logits, a tensor-parallel MoE engine and a model with dense layers are refused before
any work.

One engine per family (module-scoped), the engine core in this process, as in test_vllm_names.py;
prefix caching off, so that edits can run (`ENGINE`). scripts/mutate-tables --vllm runs these tests
against wrong tables.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from gate import need

need("vllm")

from vllm_models import MOE_FAMILIES, assert_close, config, engine, hf_model, save, shut  # noqa: E402

import hookscope as hs  # noqa: E402
from hookscope.arch import arch_of  # noqa: E402
from hookscope.engines import vllm as hv  # noqa: E402

PROMPTS = [[3, 17, 250, 9, 41], list(range(20, 57))]
ENGINE = {"enable_prefix_caching": False}  # the engine's settings (the mutation runner's too)


@pytest.fixture(scope="module")
def in_process():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        yield


@pytest.fixture(scope="module", params=list(MOE_FAMILIES))
def family(request, tmp_path_factory, in_process):
    directory = save(request.param, tmp_path_factory.mktemp(request.param))
    llm = engine(directory, **ENGINE)
    yield request.param, directory, llm
    shut(llm)


def _reference(hf, prompt: list[int], names: list[str]) -> dict[str, torch.Tensor]:
    """Hugging Face's capture of one prompt, one row per token: router and expert points are
    already [tokens, ...] (the flattened batch of one), the others [1, tokens, ...]."""
    want = hs.collect(hf, torch.tensor([prompt]), names)
    flat = {n for n in names if arch_of(hf).specs[n].pos_dim is None}
    return {n: want[n] if n in flat else want[n][0] for n in names}


def test_every_point_equals_the_hugging_face_capture(family):
    case, directory, llm = family
    hf = hf_model(directory)
    names = [p.name for p in hs.points(llm)]
    for suffix in ("mlp.in", "mlp.router.logits", "mlp.out", "resid_post"):
        assert f"blocks.1.{suffix}" in names, f"{case}: no blocks.1.{suffix}"
    assert ("blocks.1.mlp.shared.out" in names) == (case == "qwen2_moe")
    hf_names = set(arch_of(hf).specs)
    assert set(names) <= hf_names, f"{case}: names Hugging Face lacks: {set(names) - hf_names}"
    got = hs.collect(llm, PROMPTS, names)
    for prompt, rows in zip(PROMPTS, got, strict=True):
        want = _reference(hf, prompt, names)
        for name in names:
            assert_close(rows[name], want[name], f"{case} {name} ({len(prompt)} tokens)")
    # the routing is not degenerate: the long prompt's tokens do not all go to the same two experts
    chosen = got[1]["blocks.0.mlp.router.logits"].topk(2, dim=-1).indices
    assert len({tuple(sorted(row)) for row in chosen.tolist()}) > 1


def test_every_mlp_point_inside_the_fused_kernel_is_refused_by_name(family):
    case, directory, llm = family
    hf = hf_model(directory)
    names = {p.name for p in hs.points(llm)}
    hidden = sorted(n for n in arch_of(hf).specs if ".mlp." in n and n not in names)
    assert "blocks.0.mlp.experts.3.out" in hidden and "blocks.1.mlp.router.weights" in hidden
    for name in hidden:
        why = (
            "top-k"
            if ".router." in name
            else "adds the shared expert's output"
            if name.endswith("mlp.experts.out")
            else "never materialises"
        )
        with pytest.raises(hs.UnknownPointError, match=f"not readable on vLLM: .*{why}.*Hugging Face model"):
            hs.collect(llm, PROMPTS, name)
    assert ("blocks.0.mlp.experts.out" in hidden) == (case == "qwen2_moe")


def test_the_router_logits_cannot_be_written(family):
    """vLLM routes on the logits its gate returns, Hugging Face's router has routed already: a write
    would mean two things, so it is refused before any work."""
    _, _, llm = family
    edit = hs.steer("blocks.0.mlp.router.logits", torch.ones(4))
    with pytest.raises(hs.EngineError, match="cannot be written on vLLM: vLLM routes on the logits"):
        hv.collect(llm, PROMPTS, "blocks.1.resid_post", edits=[edit])


def test_an_ablation_inside_the_moe_block_equals_a_hand_written_hook(family):
    """A write through the table (Qwen2-MoE: the shared expert's down_proj output; the others: the
    fused experts' output), against a plain forward hook returning zeros on Hugging Face's module
    of the same meaning."""
    case, directory, llm = family
    hf = hf_model(directory)
    point, module = (
        ("mlp.shared.out", "shared_expert") if case == "qwen2_moe" else ("mlp.experts.out", "experts")
    )
    points = ["blocks.0.mlp.out", "blocks.1.resid_post"]
    got = hv.collect(llm, PROMPTS, points, edits=[hs.ablate(f"blocks.0.{point}")])
    zero = getattr(hf.model.layers[0].mlp, module).register_forward_hook(
        lambda m, a, out: torch.zeros_like(out)
    )
    try:
        for prompt, rows in zip(PROMPTS, got, strict=True):
            want = _reference(hf, prompt, points)
            for name in points:
                assert_close(rows[name], want[name], f"{case} {point} ablated: {name} ({len(prompt)} tokens)")
    finally:
        zero.remove()


def _hf_config(case: str, **overrides):
    kind, family_overrides = MOE_FAMILIES[case]
    hf = config(kind, 512, {**family_overrides, **overrides})
    hf.architectures = [type(hf).__name__.removesuffix("Config") + "ForCausalLM"]
    return hf


def test_a_tensor_parallel_moe_engine_is_refused_before_any_work():
    engine_config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            worker_extension_cls=hv.EXTENSION, pipeline_parallel_size=1, tensor_parallel_size=2
        ),
        model_config=SimpleNamespace(enforce_eager=True, hf_config=_hf_config("qwen2_moe")),
    )
    with pytest.raises(hs.EngineError, match="Qwen2MoeForCausalLM on a tensor-parallel engine.*=1"):
        hv.check_config(engine_config)
    engine_config.parallel_config.tensor_parallel_size = 1
    assert hv.check_config(engine_config)[0] == "Qwen2MoeForCausalLM"


def test_a_model_with_dense_layers_is_refused_with_the_layers():
    hf = _hf_config("qwen2_moe", mlp_only_layers=[1])
    with pytest.raises(hs.EngineError, match=r"dense MLP layers \[1\].*hs\.load\(path\)"):
        hv.tables.table(hf.architectures[0], hf)
