"""Mixture-of-experts families (arch/moe.py, hookscope.experts) on tiny random-init models saved
to disk: every point equals a plain register_forward_hook on a module path written by hand in
family_paths.py, never read from the table under test (per-expert points equal the
F.linear calls the model itself makes), router captures equal the model's own
output_router_logits, early stop skips later blocks, and routing edits equal hand-written hooks
or a weight-level ablation."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from family_paths import OUT, moe_paths, reference, same
from helpers import token_ids
from torch.overrides import TorchFunctionMode

import hookscope as hs
from hookscope.arch import arch_of
from hookscope.errors import HookscopeError
from hookscope.experts import ablate_expert, force_route
from hookscope.testing import MOE_FAMILIES, save_tiny

N_EXPERTS, TOP_K = 4, 2


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe(request, tmp_path_factory):
    path = save_tiny(
        request.param, tmp_path_factory.mktemp(request.param), n_layers=2, d_model=32, vocab_size=300
    )
    model = hs.load(str(path), attn_implementation="eager").model  # attn.pattern's reference
    model.config._experts_implementation = "eager"  # the per-expert reference reads its F.linear calls
    return request.param, model


_ids = partial(token_ids, low=0, seed=1)


def test_points_named(moe):
    family, model = moe
    names = arch_of(model).names
    assert arch_of(model).family == family
    for suffix in (
        "mlp.router.logits",
        "mlp.router.weights",
        "mlp.router.indices",
        "mlp.router.routing",
        "mlp.experts.3.post",
        "mlp.experts.0.tokens",
        "mlp.experts.out",
        "mlp.out",
        "attn.z",
    ):
        assert f"blocks.1.{suffix}" in names
    assert ("blocks.0.mlp.shared.out" in names) == (family == "qwen2_moe")


def test_plain_points_equal_forward_hooks(moe):
    """Every point but the per-expert ones (next tests) equals a plain hook on its module path,
    written by hand in family_paths.py."""
    family, model = moe
    arch = arch_of(model)
    ids = _ids(model)
    ref = reference(model, moe_paths(model), {"input_ids": ids, "use_cache": False})
    assert set(ref) == {n for n in arch.names if ".mlp.experts." not in n or n.endswith("experts.out")}
    acts = hs.collect(model, ids, list(ref))
    for name in ref:
        assert torch.equal(acts[name], ref[name]), name
    assert acts["blocks.0.mlp.router.logits"].shape == (2 * 7, N_EXPERTS)
    assert acts["blocks.0.mlp.router.indices"].shape == (2 * 7, TOP_K)


def test_router_equals_output_router_logits(moe):
    family, model = moe
    ids = _ids(model, seed=2)
    with torch.no_grad():
        own = model(ids, output_router_logits=True, use_cache=False).router_logits
    acts = hs.collect(model, ids, "blocks.*.mlp.router.logits")
    assert len(own) == 2
    for layer, logits in enumerate(own):
        assert torch.equal(acts[f"blocks.{layer}.mlp.router.logits"], logits)
    # the top-k the model uses are the top-k of its own softmax over those logits
    routing = hs.collect(model, ids, ["blocks.1.mlp.router.indices", "blocks.1.mlp.router.routing"])
    top = torch.softmax(own[1].float(), -1).topk(TOP_K, -1).indices
    assert torch.equal(routing["blocks.1.mlp.router.indices"].sort(-1).values, top.sort(-1).values)
    dense = routing["blocks.1.mlp.router.routing"]
    assert torch.equal((dense != 0).sum(-1), torch.full((14,), TOP_K))


class _LinearLog(TorchFunctionMode):
    """Every F.linear the model makes inside the experts module, with the weight it used."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is F.linear:
            self.calls.append((args[0].detach().clone(), args[1], out.detach().clone()))
        return out


def test_expert_points_equal_the_models_own_expert_calls(moe):
    """Per-expert rows equal the model's own F.linear calls on expert E's weight slices."""
    family, model = moe
    ids = _ids(model, seed=3)
    layer = 1
    experts = model.get_submodule(f"model.layers.{layer}.mlp.experts")
    log, index = _LinearLog(), {}

    def enter(m, args):
        index["top_k"] = args[1].clone()
        log.__enter__()

    def leave(m, args, out):
        log.__exit__(None, None, None)

    handles = [experts.register_forward_pre_hook(enter), experts.register_forward_hook(leave)]
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    points = [
        f"blocks.{layer}.mlp.experts.{e}.{w}"
        for e in range(N_EXPERTS)
        for w in ("tokens", "in", "post", "out")
    ]
    acts = hs.collect(model, ids, points)
    seen = 0
    for e in range(N_EXPERTS):
        gate_up = [c for c in log.calls if c[1].data_ptr() == experts.gate_up_proj[e].data_ptr()]
        down = [c for c in log.calls if c[1].data_ptr() == experts.down_proj[e].data_ptr()]
        tokens = acts[f"blocks.{layer}.mlp.experts.{e}.tokens"]
        if not gate_up:  # the model skipped an expert no token chose
            assert tokens.numel() == 0
            continue
        seen += 1
        assert torch.equal(acts[f"blocks.{layer}.mlp.experts.{e}.in"], gate_up[0][0])
        assert torch.equal(acts[f"blocks.{layer}.mlp.experts.{e}.post"], down[0][0])
        assert torch.equal(acts[f"blocks.{layer}.mlp.experts.{e}.out"], down[0][2])
        # the token indices: rows of the flattened batch that chose e, each once
        chose = (index["top_k"] == e).any(-1).nonzero().flatten()
        assert torch.equal(tokens.sort().values, chose)
    assert seen >= 2
    total = sum(acts[f"blocks.{layer}.mlp.experts.{e}.tokens"].numel() for e in range(N_EXPERTS))
    assert total == 2 * 7 * TOP_K


def test_expert_points_are_read_only(moe):
    family, model = moe
    with pytest.raises(HookscopeError, match="routing"):
        with hs.hooks(model) as h:
            h.forward("blocks.0.mlp.experts.1.post", lambda x, hook: x * 0)
            model(_ids(model), use_cache=False)


def test_early_stop_skips_later_blocks(moe):
    family, model = moe
    calls = {i: 0 for i in range(2)}
    experts_calls = []
    layers = model.model.layers
    handles = [
        layers[i].register_forward_pre_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
        for i in range(2)
    ]
    handles.append(layers[0].mlp.experts.register_forward_hook(lambda *a: experts_calls.append(1)))
    try:
        acts = hs.collect(model, _ids(model), ["blocks.0.mlp.experts.2.post", "blocks.0.mlp.router.logits"])
    finally:
        for h in handles:
            h.remove()
    assert acts["blocks.0.mlp.router.logits"].shape == (14, N_EXPERTS)
    assert calls == {0: 1, 1: 0}  # block 0 stopped inside, before its experts ran; block 1 never ran
    assert experts_calls == []


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def test_ablate_expert_equals_zeroed_weights_and_a_hand_hook(moe):
    family, model = moe
    ids = _ids(model, seed=4)
    clean = _logits(model, ids)
    with hs.edit(model, ablate_expert(1, 2)):
        edited = _logits(model, ids)
    assert not torch.equal(edited, clean)
    # reference 1: expert 2 of layer 1 with zero weights (its output is exactly 0)
    zeroed = copy.deepcopy(model)
    with torch.no_grad():
        zeroed.model.layers[1].mlp.experts.down_proj[2].zero_()
    assert torch.equal(edited, _logits(zeroed, ids))

    # reference 2: a plain forward hook on the router zeroing expert 2's top-k weight
    def hand(m, args, out):
        logits, weights, index = out
        return logits, torch.where(index == 2, torch.zeros_like(weights), weights), index

    h = model.model.layers[1].mlp.gate.register_forward_hook(hand)
    try:
        assert torch.equal(edited, _logits(model, ids))
    finally:
        h.remove()
    assert torch.equal(_logits(model, ids), clean)  # nothing left behind


def test_force_route_equals_a_hand_hook(moe):
    family, model = moe
    ids = _ids(model, seed=5)
    rows = [0, 3, 9]
    with hs.edit(model, force_route(0, [1, 3], [0.25, 0.75], tokens=rows)):
        edited = _logits(model, ids)
        routed = hs.collect(model, ids, "blocks.0.mlp.router.routing")["blocks.0.mlp.router.routing"]

    def hand(m, args, out):
        logits, weights, index = out
        weights, index = weights.clone(), index.clone()
        for r in rows:
            index[r] = torch.tensor([1, 3])
            weights[r] = torch.tensor([0.25, 0.75], dtype=weights.dtype)
        return logits, weights, index

    h = model.model.layers[0].mlp.gate.register_forward_hook(hand)
    try:
        assert torch.equal(edited, _logits(model, ids))
    finally:
        h.remove()
    assert torch.equal(routed[rows, 1], torch.full((3,), 0.25, dtype=routed.dtype))
    assert not torch.equal(edited, _logits(model, ids))


def test_routing_edit_errors(moe):
    family, model = moe
    with pytest.raises(HookscopeError, match="at most 2"):
        with hs.edit(model, force_route(0, [0, 1, 2])):
            _logits(model, _ids(model))
    with pytest.raises(HookscopeError, match="experts 0..3"):
        with hs.edit(model, ablate_expert(0, 7)):
            _logits(model, _ids(model))
    with pytest.raises(HookscopeError, match="14 rows"):
        with hs.edit(model, ablate_expert(0, 1, tokens=torch.ones(5, dtype=torch.bool))):
            _logits(model, _ids(model))
    # a bool mask with the router's rows works like the list of its True rows
    mask = torch.zeros(14, dtype=torch.bool)
    mask[[2, 7]] = True
    with hs.edit(model, ablate_expert(0, [0, 1], tokens=mask)):
        by_mask = _logits(model, _ids(model))
    with hs.edit(model, ablate_expert(0, [0, 1], tokens=[2, 7])):
        assert torch.equal(by_mask, _logits(model, _ids(model)))


def test_index_points_keep_their_dtype(moe):
    family, model = moe
    acts = hs.collect(
        model,
        _ids(model),
        ["blocks.0.mlp.router.indices", "blocks.0.mlp.experts.0.tokens", "blocks.0.mlp.router.logits"],
        dtype=torch.bfloat16,
    )
    assert acts["blocks.0.mlp.router.indices"].dtype == torch.int64
    assert acts["blocks.0.mlp.experts.0.tokens"].dtype == torch.int64
    assert acts["blocks.0.mlp.router.logits"].dtype == torch.bfloat16


def test_expert_points_add_up_to_the_experts_output_under_grouped_mm(moe):
    """transformers' default CPU/GPU experts kernel (grouped_mm) computes the same experts: the
    recomputed per-expert outputs, weighted and added back per token, give its mlp.experts.out."""
    family, model = moe
    ids = _ids(model, seed=6)
    points = ["blocks.1.mlp.experts.out", "blocks.1.mlp.router.routing"] + [
        f"blocks.1.mlp.experts.{e}.{w}" for e in range(N_EXPERTS) for w in ("tokens", "out")
    ]
    model.config._experts_implementation = "grouped_mm"
    try:
        acts = hs.collect(model, ids, points)
    finally:
        model.config._experts_implementation = "eager"
    routing = acts["blocks.1.mlp.router.routing"]
    total = torch.zeros_like(acts["blocks.1.mlp.experts.out"])
    for e in range(N_EXPERTS):
        tokens = acts[f"blocks.1.mlp.experts.{e}.tokens"]
        total.index_add_(0, tokens, acts[f"blocks.1.mlp.experts.{e}.out"] * routing[tokens, e, None])
    torch.testing.assert_close(total, acts["blocks.1.mlp.experts.out"])


def test_qwen2_moe_dense_layers_get_dense_points(tmp_path):
    path = save_tiny("qwen2_moe", tmp_path, n_layers=2, d_model=32, vocab_size=300)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, mlp_only_layers=[0]).eval()
    arch = arch_of(model)
    assert "blocks.0.mlp.pre" in arch.names and "blocks.0.mlp.router.logits" not in arch.names
    assert "blocks.1.mlp.router.logits" in arch.names and "blocks.1.mlp.pre" not in arch.names
    ids = _ids(model)
    paths = {
        "blocks.0.mlp.pre": ("model.layers.0.mlp.gate_proj", OUT, same),
        "blocks.0.mlp.post": ("model.layers.0.mlp.act_fn", OUT, same),  # times up_proj's: below
        "blocks.0.mlp.pre_linear": ("model.layers.0.mlp.up_proj", OUT, same),
        "blocks.0.mlp.out": ("model.layers.0.mlp", OUT, same),
        "blocks.1.mlp.shared.out": ("model.layers.1.mlp.shared_expert", OUT, same),
        "blocks.1.mlp.out": ("model.layers.1.mlp", OUT, same),
    }
    ref = reference(model, paths, {"input_ids": ids, "use_cache": False})
    ref["blocks.0.mlp.post"] = ref["blocks.0.mlp.post"] * ref["blocks.0.mlp.pre_linear"]
    acts = hs.collect(model, ids, list(paths))
    for name in paths:  # mlp.post: the model's own product act(gate) * up, so equal too
        assert torch.equal(acts[name], ref[name]), name


def test_cli_points_lists_router_and_experts(moe, tmp_path, capsys):
    from hookscope.cli import main

    family, model = moe
    path = save_tiny(family, tmp_path, n_layers=2, d_model=32, vocab_size=300)
    assert main(["points", str(path), "--pattern", "blocks.1.mlp.*"]) == 0
    out = capsys.readouterr().out
    assert f"family {family}," in out
    assert "blocks.1.mlp.router.logits" in out and "blocks.1.mlp.experts.3.post" in out
