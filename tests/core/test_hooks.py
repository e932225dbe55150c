"""Hooks by name: a `with` block leaves nothing behind, also when the forward raises; the model's
own hooks survive; permanent hooks stay until removed; attaching never calls repr(); raw module
points and glob patterns resolve to the right tensors in the right order."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import plain_hooks
from torch import Tensor, nn

import hookscope as hs
from hookscope.arch import arch_of
from hookscope.hooks import Hook, add_hook, hook_count
from hookscope.testing import build_tiny


def hook_dicts(model: nn.Module) -> dict[str, tuple]:
    """Every module's hook registries, by module path (the ids of what is registered)."""
    return {
        path: tuple(
            tuple(d)
            for d in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)
        )
        for path, m in model.named_modules()
    }


class Boom(RuntimeError):
    pass


def explode(act: Tensor, hook: Hook) -> None:
    raise Boom("hook failed")


def plain_output(model: nn.Module, module: nn.Module, ids: Tensor) -> Tensor:
    return plain_hooks(model, {"out": (module, "output", lambda o: o)}, lambda: model(ids))["out"]


def test_with_block_removes_its_hooks_when_a_hook_raises(gpt2, ids):
    own_calls = []
    own = gpt2.transformer.h[0].register_forward_hook(lambda m, a, o: own_calls.append(1))
    try:
        before_count, before = hook_count(gpt2), hook_dicts(gpt2)
        with pytest.raises(Boom), hs.hooks(gpt2) as h:
            h.forward("blocks.0.resid_post", lambda act, hook: None)
            h.forward("blocks.1.attn.z", explode)
            h.grad("blocks.0.mlp.post", lambda grad, hook: None)
            assert hook_count(gpt2) == before_count + 3
            gpt2(ids)
        assert hook_count(gpt2) == before_count
        assert hook_dicts(gpt2) == before
        own_calls.clear()
        gpt2(ids)
        assert own_calls == [1]  # the model's own hook is untouched and still fires
    finally:
        own.remove()
    assert hook_count(gpt2) == 0


def test_with_block_removes_its_hooks_when_the_model_raises(gpt2):
    before = hook_dicts(gpt2)
    bad = torch.tensor([[1, 2, gpt2.config.vocab_size + 10]])  # out of the vocabulary
    with pytest.raises(IndexError), hs.hooks(gpt2) as h, hs.capture(gpt2, "blocks.*.resid_post"):
        h.forward("blocks.2.resid_post", lambda act, hook: act * 2)
        gpt2(bad)
    assert hook_dicts(gpt2) == before
    with pytest.raises(IndexError):
        hs.collect(gpt2, bad, "blocks.1.resid_post")
    with pytest.raises(IndexError), hs.edit(gpt2, hs.ablate("blocks.1.attn.z", heads=[0])):
        gpt2(bad)
    assert hook_dicts(gpt2) == before


def test_a_hook_replaces_the_activation(gpt2, ids):
    ln_f_input = []
    probe = gpt2.transformer.ln_f.register_forward_pre_hook(lambda m, a: ln_f_input.append(a[0].clone()))
    try:
        with torch.no_grad(), hs.hooks(gpt2) as h:
            h.forward("blocks.2.resid_post", lambda act, hook: act * 0 + 7)
            gpt2(ids)
    finally:
        probe.remove()
    assert torch.equal(ln_f_input[0], torch.full_like(ln_f_input[0], 7.0))
    assert hook_count(gpt2) == 0


def test_an_attach_registers_the_hook_itself_and_nothing_else(gpt2):
    block = gpt2.transformer.h[1]
    with hs.hooks(gpt2) as h:
        hook = h.forward("blocks.1.resid_post", lambda act, hook: None)
        # no wrapper in between: torch holds the Hook object, which reads the point's view
        assert list(block._forward_hooks.values()) == [hook] and hook_count(gpt2) == 1
    assert not hook.attached and hook_count(gpt2) == 0


def test_permanent_hook_stays_until_removed(gpt2, ids):
    want = plain_output(gpt2, gpt2.transformer.h[1], ids)
    seen = []
    hook = add_hook(gpt2, "blocks.1.resid_post", lambda act, h: seen.append(act.clone()))
    assert hook.attached and hook_count(gpt2) == 1
    with torch.no_grad():
        gpt2(ids)
        gpt2(ids[:1])
    assert [s.shape[0] for s in seen] == [2, 1]
    assert torch.equal(seen[0], want)
    hook.remove()
    assert not hook.attached and hook_count(gpt2) == 0
    gpt2(ids)
    assert len(seen) == 2
    hook.remove()  # removing twice is harmless


class ReprCounter:
    """A callable hook whose repr raises (and counts how often it was asked)."""

    calls = 0

    def __init__(self):
        self.seen = 0

    def __call__(self, act: Tensor, hook: Hook) -> None:
        self.seen += 1

    def __repr__(self) -> str:
        ReprCounter.calls += 1
        raise AssertionError("repr() called on a hook")


class TensorBag(dict):
    """A dict of tensors whose repr counts calls: what a partial-with-state hook carries."""

    calls = 0

    def __repr__(self) -> str:
        TensorBag.calls += 1
        return "TensorBag(...)"


def record(act: Tensor, hook: Hook, *, bag: dict) -> None:
    bag[hook.point] = act.detach().clone()


def test_attaching_never_calls_repr(gpt2, ids):
    ReprCounter.calls = TensorBag.calls = 0
    obj = ReprCounter()
    bag = TensorBag({f"w{i}": torch.zeros(64, 8) for i in range(200)})
    fn = functools.partial(record, bag=bag)
    with hs.hooks(gpt2) as h:
        a = h.forward("blocks.0.resid_post", obj)
        b = h.forward("blocks.1.resid_post", fn)
        c = h.grad("blocks.1.mlp.post", obj)
        loss = gpt2(ids).logits.sum()
        torch.autograd.grad(loss, [gpt2.transformer.wte.weight])  # fires the gradient hook
    permanent = add_hook(gpt2, "blocks.2.resid_post", fn)
    gpt2(ids)
    permanent.remove()
    assert ReprCounter.calls == 0 and TensorBag.calls == 0
    assert obj.seen == 2  # once forward, once backward
    assert torch.equal(bag["blocks.1.resid_post"], plain_output(gpt2, gpt2.transformer.h[1], ids))
    assert "blocks.2.resid_post" in bag
    # a readable name only when asked for, still without repr() of the hook's state
    assert a.name == "forward hook ReprCounter instance on blocks.0.resid_post"
    assert b.name == "forward hook partial(record) on blocks.1.resid_post"
    assert c.name == "grad hook ReprCounter instance on blocks.1.mlp.post"
    assert ReprCounter.calls == 0 and TensorBag.calls == 0
    assert hook_count(gpt2) == 0


def test_unknown_names_suggest_close_ones(gpt2):
    with pytest.raises(hs.UnknownPointError, match="blocks.1.resid_post") as typo:
        hs.collect(gpt2, torch.tensor([[1, 2]]), "blocks.1.resid_pots")
    assert isinstance(typo.value, hs.HookscopeError) and isinstance(typo.value, KeyError)
    with pytest.raises(hs.UnknownPointError, match=r"blocks 0-2") as far, hs.hooks(gpt2) as h:
        h.forward("blocks.99.resid_post", lambda act, hook: None)
    assert "blocks.2.resid_post" in str(far.value)
    with pytest.raises(hs.UnknownPointError, match="matches no point"):
        hs.capture(gpt2, "blocks.*.resid_pots")
    with pytest.raises(hs.UnknownPointError, match="no module"):
        hs.collect(gpt2, torch.tensor([[1, 2]]), "module:transformer.h.9:output")
    assert hook_count(gpt2) == 0


def test_raw_module_points_equal_plain_hooks(gpt2, ids):
    c_fc, ln_2 = gpt2.transformer.h[1].mlp.c_fc, gpt2.transformer.h[1].ln_2
    ln_2_input = []
    handle = ln_2.register_forward_pre_hook(lambda m, a: ln_2_input.append(a[0].clone()))
    try:
        with torch.no_grad():
            gpt2(ids)
    finally:
        handle.remove()
    got = hs.collect(
        gpt2,
        ids,
        [
            "module:transformer.h.1.mlp.c_fc:output",
            "module:transformer.h.1.ln_2:input",
            "module:transformer.h.1.mlp.c_fc",
        ],
    )  # :output by default
    assert torch.equal(got["module:transformer.h.1.mlp.c_fc:output"], plain_output(gpt2, c_fc, ids))
    assert torch.equal(got["module:transformer.h.1.ln_2:input"], ln_2_input[0])
    assert torch.equal(
        got["module:transformer.h.1.ln_2:input"],
        hs.collect(gpt2, ids, "blocks.1.resid_mid")["blocks.1.resid_mid"],
    )
    with pytest.raises(hs.UnknownPointError, match="input or :output"):
        hs.collect(gpt2, ids, "module:transformer.h.1:middle")


def test_glob_patterns_expand_in_layer_order():
    model = build_tiny("gpt2", n_layers=12, d_model=16, n_heads=2, vocab_size=32)
    arch = arch_of(model)
    names = [s.name for s in arch.resolve("blocks.*.resid_post")]
    assert names == [f"blocks.{i}.resid_post" for i in range(12)]  # 10 after 9, not after 1
    got = hs.collect(model, torch.tensor([[1, 2, 3]]), "blocks.*.resid_post")
    assert list(got) == names
    for i in range(12):
        assert torch.equal(
            got[f"blocks.{i}.resid_post"],
            plain_output(model, model.transformer.h[i], torch.tensor([[1, 2, 3]])),
        )
    assert [s.name for s in arch.resolve("blocks.1?.attn.[qk]")] == [
        f"blocks.{i}.attn.{x}" for i in (10, 11) for x in "qk"
    ]


def test_module_backward_and_pre_forward_hooks(gpt2, ids):
    """The full backward hook sees d loss / d output of the module, as a plain one does."""
    before = hook_dicts(gpt2)
    plain, ours = [], []
    handle = gpt2.transformer.h[1].register_full_backward_hook(lambda m, gi, go: plain.append(go[0].clone()))
    try:
        gpt2(ids).logits.square().mean().backward()
    finally:
        handle.remove()
    pre_calls = []
    with hs.hooks(gpt2) as h:
        h.module_backward("blocks.1.resid_post", lambda m, gi, go: ours.append(go[0].clone()))
        h.module_pre_forward("blocks.1.resid_pre", lambda m, args, kwargs: pre_calls.append(args[0].shape))
        gpt2(ids).logits.square().mean().backward()
    gpt2.zero_grad(set_to_none=True)
    assert torch.equal(ours[0], plain[0])
    assert pre_calls == [ids.shape + (64,)]
    assert hook_dicts(gpt2) == before
