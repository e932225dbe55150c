"""Gradients by point name equal `torch.autograd.grad` with respect to the same activations,
captured by plain torch hooks; tensor-gradient hooks see the same values; frozen weights work."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs
from hookscope.hooks import hook_count
from hookscope.testing import build_tiny

POINTS = ["blocks.1.attn.z", "blocks.1.mlp.post", "blocks.1.resid_post"]


def loss_fn(out) -> Tensor:
    """Log-probability of token 3 at the last position: a loss that reaches every layer."""
    return out.logits[:, -1].log_softmax(-1)[:, 3].sum()


def modules_of(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """(module, side) holding each point, read off the Hugging Face module tree."""
    if model.config.model_type == "gpt2":
        blk = model.transformer.h[1]
        return {
            "blocks.1.attn.z": (blk.attn.c_proj, "input"),
            "blocks.1.mlp.post": (blk.mlp.c_proj, "input"),
            "blocks.1.resid_post": (blk, "output"),
        }
    blk = model.model.layers[1]
    return {
        "blocks.1.attn.z": (blk.self_attn.o_proj, "input"),
        "blocks.1.mlp.post": (blk.mlp.down_proj, "input"),
        "blocks.1.resid_post": (blk, "output"),
    }


def reference_grads(model: nn.Module, ids: Tensor) -> dict[str, Tensor]:
    """d loss / d activation by torch.autograd.grad on activations kept by plain hooks
    (the model's weights require grad, so every activation is part of the graph)."""
    acts: dict[str, Tensor] = {}
    handles = []
    for name, (module, side) in modules_of(model).items():
        if side == "output":
            handles.append(module.register_forward_hook(lambda m, a, o, name=name: acts.__setitem__(name, o)))
        else:
            handles.append(
                module.register_forward_pre_hook(lambda m, a, name=name: acts.__setitem__(name, a[0]))
            )
    try:
        loss = loss_fn(model(ids))
    finally:
        for h in handles:
            h.remove()
    grads = dict(zip(POINTS, torch.autograd.grad(loss, [acts[p] for p in POINTS]), strict=True))
    H = model.config.num_attention_heads
    z = grads["blocks.1.attn.z"]
    grads["blocks.1.attn.z"] = z.view(z.shape[0], z.shape[1], H, z.shape[2] // H)  # per head
    return grads


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_grads_equal_autograd(tiny, make_ids, family):
    model = tiny[family].model
    ids = make_ids(model)
    want = reference_grads(model, ids)
    got = hs.grads(model, ids, POINTS, loss_fn)
    assert list(got) == POINTS
    for name in POINTS:
        assert got[name].shape == want[name].shape, name
        assert torch.equal(got[name], want[name]), name
        assert got[name].abs().sum() > 0, name
    assert hook_count(model) == 0
    assert all(p.grad is None for p in model.parameters())  # autograd.grad, not .backward()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_grads_with_frozen_weights(family, make_ids):
    """d loss / d activation does not depend on whether the weights require grad."""
    model = build_tiny(family)
    ids = make_ids(model)
    want = reference_grads(model, ids)
    model.requires_grad_(False)
    got = hs.grads(model, ids, POINTS + ["embed"], loss_fn)
    for name in POINTS:
        assert torch.equal(got[name], want[name]), name
    assert got["embed"].shape == ids.shape + (64,) and got["embed"].abs().sum() > 0


def test_tensor_grad_hook_sees_the_same_gradient(gpt2, ids):
    want = reference_grads(gpt2, ids)
    seen: dict[str, Tensor] = {}
    with hs.hooks(gpt2) as h:
        for name in POINTS:
            h.grad(name, lambda grad, hook: seen.__setitem__(hook.point, grad.clone()))
        loss = loss_fn(gpt2(ids))
        torch.autograd.grad(loss, [gpt2.transformer.wte.weight])
    assert hook_count(gpt2) == 0
    for name in POINTS:
        assert torch.equal(seen[name], want[name]), name


def test_grad_hook_can_replace_the_gradient(gpt2, ids):
    """Zeroing d loss / d blocks.1.resid_post zeroes every gradient that flows only through it."""
    w = gpt2.transformer.h[0].mlp.c_fc.weight
    (plain,) = torch.autograd.grad(loss_fn(gpt2(ids)), [w])
    assert plain.abs().sum() > 0
    with hs.hooks(gpt2) as h:
        h.grad("blocks.1.resid_post", lambda grad, hook: torch.zeros_like(grad))
        (cut,) = torch.autograd.grad(loss_fn(gpt2(ids)), [w])
    assert torch.equal(cut, torch.zeros_like(w))


def test_grad_errors(gpt2, ids):
    with pytest.raises(hs.SelectionError, match="scalar"):
        hs.grads(gpt2, ids, "blocks.0.resid_post", lambda out: out.logits)
    with pytest.raises(hs.HookscopeError, match="attn.pattern"):
        hs.grads(gpt2, ids, "blocks.0.attn.pattern", loss_fn)
    with pytest.raises(hs.HookscopeError, match="gradients off"), hs.hooks(gpt2) as h, torch.no_grad():
        h.grad("blocks.0.resid_post", lambda grad, hook: None)
        gpt2(ids)
    assert hook_count(gpt2) == 0


def test_grads_are_keyed_by_the_names_asked_for(gpt2, ids):
    want = reference_grads(gpt2, ids)
    got = hs.grads(gpt2, ids, ["blocks.1.hook_resid_post", "blocks.*.mlp.post"], loss_fn)
    assert list(got) == [
        "blocks.1.hook_resid_post",
        "blocks.0.mlp.post",
        "blocks.1.mlp.post",
        "blocks.2.mlp.post",
    ]
    assert torch.equal(got["blocks.1.hook_resid_post"], want["blocks.1.resid_post"])
    assert got["blocks.1.resid_post"] is got["blocks.1.hook_resid_post"]  # any spelling reads it
    assert torch.equal(got["blocks.1.mlp.post"], want["blocks.1.mlp.post"])
    assert hook_count(gpt2) == 0
