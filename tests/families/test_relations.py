"""Relations every point of every family must satisfy, whatever module a table names: the
residual stream adds what each sublayer returns, mlp.post is the activation of mlp.pre, per-head
points are the projections of the normed input and pattern @ v = z, a MoE layer's output is the
routed sum of its experts, ... The references are the Hugging Face modules named by hand in
family_relations*.py, never hookscope's tables, so a table entry pointing at a neighbouring
module, input for output, or the layer before breaks a relation (scripts/mutate-tables checks
that it does, one wrong entry at a time).

Tiny random models in float64 with every parameter nudged off its initial value (family_models),
one forward pass each. Tolerance 1e-6 (relative and absolute): some steps run in float32 even in
a float64 model (eager attention's softmax, the MoE routers), against differences of order 0.1
for a wrong module."""

from __future__ import annotations

import family_models
import pytest
import torch
from family_relations import Reads, bert_relations, gpt2_relations, llama_relations, neox_relations
from family_relations_vision_moe_ssm import (
    clip_relations,
    dinov2_relations,
    mamba_relations,
    moe_relations,
    rwkv_relations,
    vit_relations,
)

import hookscope as hs
from hookscope.arch import arch_of

TOL = 1e-6
RELATIONS = {
    "gpt2": gpt2_relations,
    "llama": llama_relations,
    "gpt_neox": neox_relations,
    "bert": bert_relations,
    "vit": vit_relations,
    "clip": clip_relations,
    "siglip": clip_relations,
    "dinov2": dinov2_relations,
    "dinov2_with_registers": dinov2_relations,
    "mamba": mamba_relations,
    "falcon_mamba": mamba_relations,
    "rwkv": rwkv_relations,
    **{mt: llama_relations for mt in family_models.LLAMA_LIKE},
    **{mt: moe_relations for mt in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")},
}


@pytest.mark.parametrize("case", list(family_models.CASES))
def test_relations(case):
    model = family_models.build(case)
    inputs = family_models.inputs(case)
    arch = arch_of(model)
    acts = hs.collect(model, inputs, arch.names)
    reads = Reads(acts)
    with torch.no_grad():
        checks = RELATIONS[arch.family](model, next(iter(inputs.values())), reads)
    failed = []
    for label, got, want in checks:
        try:
            torch.testing.assert_close(got, want.to(got.dtype), rtol=TOL, atol=TOL)
        except AssertionError as error:
            failed.append(f"{label}: {str(error).splitlines()[0]}")
    assert not failed, "\n".join(failed)
    assert reads.read == set(arch.names), f"points no relation holds: {set(arch.names) - reads.read}"
    # each point captured alone (the forward stops right after it) is the same tensor: a module
    # called twice in a block (ViT's dropout) gives a point one value alone, another in company
    for name in arch.names:
        alone = hs.collect(model, inputs, name)[name]
        assert alone.shape == acts[name].shape and torch.equal(alone, acts[name]), name


def test_a_wrong_module_breaks_a_relation():
    """The issue's two survivors, by hand: ViT's mlp.post read at fc1's output (the pre-activation),
    CLIP's resid_mid at layer_norm1's input (resid_pre) each break a relation."""
    for case, point, target in (
        ("vit", "blocks.0.mlp.post", "mlp.pre"),
        ("clip", "blocks.0.resid_mid", "resid_pre"),
    ):
        model = family_models.build(case)
        inputs = family_models.inputs(case)
        acts = dict(hs.collect(model, inputs, arch_of(model).names))
        acts[point] = acts[point.replace(point.split(".", 2)[2], target)]
        with torch.no_grad():
            checks = RELATIONS[arch_of(model).family](model, inputs["pixel_values"], Reads(acts))
        broken = [
            label
            for label, got, want in checks
            if got.shape != want.shape or not torch.allclose(got, want.to(got.dtype), rtol=TOL, atol=TOL)
        ]
        assert broken, (case, point)
