"""TransformerLens 4.x `TransformerBridge` as a model family, tested like the others.

Bridges over the tiny GPT-2, Llama and GPT-NeoX models (random init, saved with save_pretrained,
tokenizer trained offline), booted offline with `TransformerBridge.boot_transformers(dir,
hf_model=...)`. The references are independent of hookscope:
- the bridge's own `run_with_cache` (every point, same name, same tensor, same shape);
- the bridge's own `run_with_hooks` (per-head edits);
- the Hugging Face model underneath, loaded again from the same directory with eager attention
  and read by hookscope's Hugging Face family tables (where the point exists in both);
- the attention output computed by hand from the HF weights (a head edit hits that head).

Runs in the `tl4` test environment (scripts/test-all: TransformerLens 4 cannot share a venv with
3.9); elsewhere it skips, saying why. With HOOKSCOPE_REQUIRE=tl4 (set by scripts/test-all) a
missing TransformerLens 4 is a failure, never a silent skip.
"""

from __future__ import annotations

import pytest
import torch
from gate import need
from helpers import token_ids

import hookscope as hs
from hookscope.arch import arch_of
from hookscope.hooks import hook_count

need("tl4")

from transformer_lens.model_bridge import TransformerBridge  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from hookscope.arch import tl_bridge  # noqa: E402

FAMILIES = ["gpt2", "llama", "neox_parallel", "neox_sequential"]


@pytest.fixture(scope="module")
def bridges(tiny_dirs) -> dict[str, TransformerBridge]:
    out = {}
    for key in FAMILIES:
        path = str(tiny_dirs[key])
        hf = AutoModelForCausalLM.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        out[key] = TransformerBridge.boot_transformers(
            path, hf_model=hf, tokenizer=tokenizer, device="cpu"
        ).eval()
    return out


@pytest.fixture(scope="module")
def hf_models(tiny_dirs) -> dict[str, torch.nn.Module]:
    """The same weights as plain Hugging Face models (eager attention, as the bridge forces)."""
    return {
        key: AutoModelForCausalLM.from_pretrained(str(tiny_dirs[key]), attn_implementation="eager").eval()
        for key in FAMILIES
    }


def hooks_on(bridge) -> int:
    """Torch hooks on the bridge's HookPoints and its root: where hookscope attaches. (The bridge
    itself adds hooks of its own to the wrapped model's modules on its first forward passes.)"""
    modules = [bridge, *{id(hp): hp for hp in bridge.hook_dict.values()}.values()]
    return sum(hook_count(m) - sum(hook_count(c) for c in m.children()) for m in modules)


ids_for = token_ids


def test_environment_is_tl4():
    import importlib.metadata

    import transformer_lens

    assert importlib.metadata.version("transformer-lens").startswith("4.")
    assert hasattr(transformer_lens, "model_bridge")


# --- every point the bridge caches, under the same name, same tensor, same shape --------------


@pytest.mark.parametrize("key", FAMILIES)
def test_every_point_equals_run_with_cache(bridges, key):
    bridge = bridges[key]
    ids = ids_for(bridge)
    before = hooks_on(bridge)
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(ids)
    arch = arch_of(bridge)
    by_point: dict[str, list[str]] = {}
    for tl_name in cache.keys():
        by_point.setdefault(arch.spec(tl_name).name, []).append(tl_name)
    # what a plain forward caches is exactly what hs.points lists (logits aside)
    assert set(by_point) == set(arch.names) - {"logits"}
    got = hs.collect(bridge, ids, list(by_point) + ["logits"])
    for name, tl_names in by_point.items():
        for tl_name in tl_names:
            assert got[name].shape == cache[tl_name].shape, (name, tl_name)
            assert torch.equal(got[name], cache[tl_name]), (name, tl_name)
    assert torch.equal(got["logits"], logits)
    # asked for in the bridge's own spellings, every one of them
    got = hs.collect(bridge, ids, list(cache.keys()))
    for tl_name in cache.keys():
        assert torch.equal(got[arch.spec(tl_name).name], cache[tl_name]), tl_name
    assert hooks_on(bridge) == before


@pytest.mark.parametrize("key", FAMILIES)
def test_points_lists_true_shapes(bridges, key):
    bridge = bridges[key]
    ids = ids_for(bridge, batch=2, length=5)
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids)
    arch = arch_of(bridge)
    infos = hs.points(bridge, ids)
    assert [i.name for i in infos] == arch.names
    for info in infos:
        assert info.shape is not None, f"{info.name} is listed but did not fire"
        if info.name != "logits":
            assert info.shape == tuple(
                cache[
                    info.name
                    if info.name in cache
                    else next(k for k in cache.keys() if arch.spec(k).name == info.name)
                ].shape
            ), info.name
    cfg = bridge.cfg
    n_kv = getattr(cfg, "n_key_value_heads", None) or cfg.n_heads
    shapes = {i.name: i.shape for i in infos}
    for layer in range(cfg.n_layers):
        assert shapes[f"blocks.{layer}.attn.q"] == (2, 5, cfg.n_heads, cfg.d_head)
        assert shapes[f"blocks.{layer}.attn.k"] == (2, 5, n_kv, cfg.d_head)
        assert shapes[f"blocks.{layer}.attn.v"] == (2, 5, n_kv, cfg.d_head)
        assert shapes[f"blocks.{layer}.attn.z"] == (2, 5, cfg.n_heads, cfg.d_head)
        assert shapes[f"blocks.{layer}.attn.pattern"] == (2, cfg.n_heads, 5, 5)
    # every per-head point says where its heads and positions are
    for name in arch.names:
        spec = arch.specs[name]
        if spec.head_dim is not None:
            assert shapes[name][spec.head_dim] in (cfg.n_heads, n_kv), name
        if spec.pos_dim is not None and name != "logits":
            assert shapes[name][spec.pos_dim] == 5, name


# --- names: every spelling names one HookPoint, and it fires ----------------------------------


@pytest.mark.parametrize("key", FAMILIES)
def test_every_spelling_names_its_own_hook_point(bridges, key):
    bridge = bridges[key]
    arch = arch_of(bridge)
    hook_dict = bridge.hook_dict
    points = {**arch.specs, **{n: p.spec for n, p in arch.optional.items()}}
    # one point per HookPoint object, and no HookPoint left out
    modules = [arch.modules[s.name] for s in points.values() if s.name != "logits"]
    assert len({id(m) for m in modules}) == len(modules)
    assert {id(m) for m in modules} == {id(hp) for hp in hook_dict.values()}
    for spelling, hook_point in hook_dict.items():
        name = arch.aliases[spelling]
        assert arch.modules[name] is hook_point, spelling
    # a folded spelling (hook_ dropped) names one HookPoint: never two
    for alias, name in arch.aliases.items():
        assert name in points, alias
        assert arch.modules[name] is hook_dict.get(alias, arch.modules[name]), alias


def test_mlp_in_is_what_the_mlp_reads(bridges):
    """`blocks.0.mlp.in` is the MLP's input after ln2 (the bridge's `mlp.hook_in`), as on the Hugging
    Face families; TransformerLens's `blocks.0.hook_mlp_in` (the residual before ln2, behind
    use_hook_mlp_in) is another HookPoint and another point, `blocks.0.mlp.in_pre_norm`."""
    bridge = bridges["gpt2"]
    ids = ids_for(bridge)
    before = hooks_on(bridge)
    arch = arch_of(bridge)
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids)
    got = hs.collect(bridge, ids, "blocks.0.mlp.in")["blocks.0.mlp.in"]
    assert torch.equal(got, cache["blocks.0.mlp.hook_in"])
    assert torch.equal(got, cache["blocks.0.ln2.hook_out"])
    assert not torch.allclose(got, cache["blocks.0.hook_resid_mid"])
    assert arch.aliases["blocks.0.mlp.hook_in"] == "blocks.0.mlp.in"
    assert arch.aliases["blocks.0.hook_mlp_in"] == "blocks.0.mlp.in_pre_norm"
    assert arch.modules["blocks.0.mlp.in"] is bridge.hook_dict["blocks.0.mlp.hook_in"]
    assert arch.modules["blocks.0.mlp.in_pre_norm"] is bridge.hook_dict["blocks.0.hook_mlp_in"]
    assert "blocks.0.mlp.in" in arch.names
    with pytest.raises(hs.UnknownPointError, match=r"set_use_hook_mlp_in\(True\)"):
        hs.collect(bridge, ids, "blocks.0.hook_mlp_in")
    assert "blocks.0.mlp.in_pre_norm" not in arch.names  # listed only when it fires
    bridge.set_use_hook_mlp_in(True)
    try:
        with torch.no_grad():
            _, cache = bridge.run_with_cache(ids)
        got = hs.collect(bridge, ids, "blocks.0.hook_mlp_in")["blocks.0.mlp.in_pre_norm"]
        assert torch.equal(got, cache["blocks.0.hook_mlp_in"])
        assert torch.equal(got, cache["blocks.0.hook_resid_mid"])  # pre-ln2, as in TransformerLens 3
    finally:
        bridge.set_use_hook_mlp_in(False)
    assert hooks_on(bridge) == before


OPTIONS = {
    "use_attn_result": "set_use_attn_result",
    "use_split_qkv_input": "set_use_split_qkv_input",
    "use_attn_in": "set_use_attn_in",
    "use_hook_mlp_in": "set_use_hook_mlp_in",
}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("key", ["gpt2", "llama"])
def test_optional_points_fire_with_their_option(bridges, key, option):
    bridge = bridges[key]
    ids = ids_for(bridge)
    before = hooks_on(bridge)
    arch = arch_of(bridge)
    gated = [n for n, p in arch.optional.items() if p.needs == f"bridge.{OPTIONS[option]}(True)"]
    assert gated, f"no point of {key} is gated by {option}"
    for name in gated:
        with pytest.raises(hs.UnknownPointError, match=OPTIONS[option]):
            hs.collect(bridge, ids, name)
    getattr(bridge, OPTIONS[option])(True)
    try:
        with torch.no_grad():
            _, cache = bridge.run_with_cache(ids)
        got = hs.collect(bridge, ids, gated)
        for name in gated:
            spellings = [k for k in cache.keys() if arch.aliases.get(k) == name]
            assert spellings, f"{name} did not fire with {option} on"
            for k in spellings:
                assert torch.equal(got[name], cache[k]), (name, k)
    finally:
        getattr(bridge, OPTIONS[option])(False)
    assert hooks_on(bridge) == before


def test_optional_points_stay_out_of_patterns(bridges):
    bridge = bridges["gpt2"]
    arch = arch_of(bridge)
    assert "blocks.0.attn.result" in arch.optional
    assert "blocks.0.attn.result" not in [s.name for s in arch.resolve("blocks.0.attn.*")]
    assert tl_bridge.optional_points(arch)["blocks.0.attn.result"] == "bridge.set_use_attn_result(True)"


# --- heads: selections and edits address heads -----------------------------------------------


@pytest.mark.parametrize("key", ["gpt2", "llama"])
def test_head_selections_match_cache_slices(bridges, key):
    bridge = bridges[key]
    ids = ids_for(bridge)
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids)
    got = hs.collect(
        bridge, ids, ["blocks.1.attn.hook_z", "blocks.1.attn.hook_q"], heads=[3, 1], positions=slice(2, 5)
    )
    assert torch.equal(got["blocks.1.attn.z"], cache["blocks.1.attn.hook_z"][:, 2:5][:, :, [3, 1]])
    assert torch.equal(got["blocks.1.attn.q"], cache["blocks.1.attn.hook_q"][:, 2:5][:, :, [3, 1]])
    # patterns are [batch, head, query, key]: positions pick queries
    got = hs.collect(bridge, ids, "blocks.0.attn.hook_pattern", heads=2, positions="last")
    assert torch.equal(got["blocks.0.attn.pattern"], cache["blocks.0.attn.hook_pattern"][:, [2], -1])


def zero_head(head: int):
    def hook(z, hook):
        z = z.clone()
        z[:, :, head] = 0
        return z

    return hook


@pytest.mark.parametrize("key", FAMILIES)
def test_head_edits_equal_run_with_hooks(bridges, key):
    bridge = bridges[key]
    ids = ids_for(bridge)
    before = hooks_on(bridge)
    with torch.no_grad():
        plain = bridge(ids)
        want = bridge.run_with_hooks(ids, fwd_hooks=[("blocks.1.attn.hook_z", zero_head(1))])
        with hs.edit(bridge, hs.ablate("blocks.1.attn.z", heads=[1])):
            got = bridge(ids)
    assert torch.equal(got, want)
    assert not torch.equal(got, plain)
    # a patch of one head of q from another input, against the same patch through TL's hooks
    other = ids_for(bridge, seed=1)
    with torch.no_grad():
        _, source_cache = bridge.run_with_cache(other, names_filter="blocks.0.attn.hook_q")
    source = source_cache["blocks.0.attn.hook_q"]

    def patch_head_2(q, hook):
        q = q.clone()
        q[:, :, 2] = source[:, :, 2]
        return q

    with torch.no_grad():
        want = bridge.run_with_hooks(ids, fwd_hooks=[("blocks.0.attn.hook_q", patch_head_2)])
        clean = hs.collect(bridge, other, "blocks.0.attn.q")["blocks.0.attn.q"]
        with hs.edit(bridge, hs.patch("blocks.0.attn.q", clean, heads=[2])):
            got = bridge(ids)
    assert torch.equal(got, want)
    assert hooks_on(bridge) == before


@pytest.mark.parametrize("key", ["gpt2", "llama", "neox_parallel"])
def test_head_edit_hits_the_head_in_the_model_underneath(bridges, hf_models, key):
    """Independent of TransformerLens: zeroing head 1 of z through the bridge equals zeroing that
    head's slice of the output projection's input in the plain Hugging Face model."""
    bridge, hf = bridges[key], hf_models[key]
    ids = ids_for(bridge)
    d_head = bridge.cfg.d_head
    proj = {
        "gpt2": "transformer.h.1.attn.c_proj",
        "llama": "model.layers.1.self_attn.o_proj",
        "neox_parallel": "gpt_neox.layers.1.attention.dense",
    }[key]

    def zero_slice(module, args):
        x = args[0].clone()
        x[..., d_head : 2 * d_head] = 0
        return (x, *args[1:])

    handle = hf.get_submodule(proj).register_forward_pre_hook(zero_slice)
    try:
        with torch.no_grad():
            want = hf(ids).logits
    finally:
        handle.remove()
    with torch.no_grad(), hs.edit(bridge, hs.ablate("blocks.1.attn.z", heads=[1])):
        got = bridge(ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and the same edit by name on the Hugging Face model itself
    with torch.no_grad(), hs.edit(hf, hs.ablate("blocks.1.attn.z", heads=[1])):
        assert torch.equal(hf(ids).logits, want)
    with torch.no_grad():
        assert (bridge(ids) - want).abs().max() > 1e-3  # the edit made a difference


# --- the bridge against the Hugging Face model underneath --------------------------------------


@pytest.mark.parametrize("key", FAMILIES)
def test_captures_equal_the_hugging_face_model(bridges, hf_models, key):
    bridge, hf = bridges[key], hf_models[key]
    ids = ids_for(bridge)
    bridge_points = set(arch_of(bridge).names)
    shared = [n for n in arch_of(hf).names if n in bridge_points]
    # the points every decoder family has, at least
    for layer in range(bridge.cfg.n_layers):
        for suffix in (
            "resid_pre",
            "attn.q",
            "attn.k",
            "attn.v",
            "attn.pattern",
            "attn.z",
            "attn.out",
            "mlp.pre",
            "mlp.post",
            "mlp.out",
            "resid_post",
        ):
            assert f"blocks.{layer}.{suffix}" in shared, (key, suffix)
    assert {"embed", "ln_final", "logits"} <= set(shared)
    ours = hs.collect(bridge, ids, shared)
    theirs = hs.collect(hf, ids, shared)
    for name in shared:
        a, b = ours[name], theirs[name]
        if name == "pos_embed":  # Hugging Face embeds positions once, broadcast over the batch
            b = b.expand_as(a)
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


# --- errors leave nothing behind --------------------------------------------------------------


def test_no_hook_left_after_an_error(bridges):
    bridge = bridges["gpt2"]
    ids = ids_for(bridge)
    before = hooks_on(bridge)

    def boom(act, hook):
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"), hs.hooks(bridge) as h:
        h.forward("blocks.0.attn.z", boom)
        bridge(ids)
    assert hooks_on(bridge) == before
    with pytest.raises(hs.SelectionError), hs.edit(bridge, hs.patch("blocks.0.attn.z", torch.zeros(1, 2, 3))):
        bridge(ids)
    assert hooks_on(bridge) == before
    with pytest.raises(hs.UnknownPointError, match="blocks.0.resid_post"):
        hs.collect(bridge, ids, ["blocks.0.resid_post", "blocks.0.resid_psot"])
    with pytest.raises(hs.UnknownPointError, match="never fires"):
        hs.collect(bridge, ids, "blocks.0.attn.qkv.hook_out")
    assert hooks_on(bridge) == before
    # and the bridge still runs clean
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids, names_filter="blocks.1.hook_resid_post")
    assert torch.equal(
        hs.collect(bridge, ids, "blocks.1.resid_post")["blocks.1.resid_post"],
        cache["blocks.1.hook_resid_post"],
    )


def test_early_stop_runs_no_later_block(bridges):
    bridge = bridges["gpt2"]
    ids = ids_for(bridge)
    ran = []
    handles = [
        block.register_forward_pre_hook(lambda m, a, i=i: ran.append(i))
        for i, block in enumerate(bridge.blocks)
    ]
    try:
        got = hs.collect(bridge, ids, "blocks.0.hook_resid_post")
    finally:
        for handle in handles:
            handle.remove()
    assert ran == [0]
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids, names_filter="blocks.0.hook_resid_post")
    assert torch.equal(got["blocks.0.resid_post"], cache["blocks.0.hook_resid_post"])


# --- what engineer A's core work brings (issue 13 items 2 and 5) -------------------------------


def test_results_are_keyed_by_the_name_asked_for(bridges):
    bridge = bridges["gpt2"]
    ids = ids_for(bridge)
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids)
    for name in ("blocks.0.hook_resid_post", "blocks.0.attn.q.hook_out", "blocks.0.attn.hook_z"):
        assert torch.equal(hs.collect(bridge, ids, name)[name], cache[name])


def test_mean_ablation_of_a_pattern_averages_positions(bridges):
    bridge = bridges["gpt2"]
    ids = ids_for(bridge)

    def mean_over_queries(pattern, hook):  # [batch, head, query, key]: positions are dim 2
        return pattern.mean(dim=(0, 2), keepdim=True).expand_as(pattern)

    with torch.no_grad():
        want = bridge.run_with_hooks(ids, fwd_hooks=[("blocks.0.attn.hook_pattern", mean_over_queries)])
        with hs.edit(bridge, hs.ablate("blocks.0.attn.pattern", how="mean")):
            got = bridge(ids)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("key", ["gpt2", "llama"])
def test_grads_equal_the_bridges_backward_hooks(bridges, key):
    bridge = bridges[key]
    ids = ids_for(bridge)
    before = hooks_on(bridge)
    got = hs.grads(
        bridge, ids, ["blocks.0.attn.z", "blocks.1.resid_mid"], loss_fn=lambda out: out[:, -1].sum()
    )
    # the reference: d loss / d activation from the bridge's own HookPoints, by hand
    kept = {}

    def keep(act, hook):
        act.retain_grad()  # returned, so the rest of the forward pass is computed from it
        kept[hook.name] = act
        return act

    logits = bridge.run_with_hooks(
        ids, fwd_hooks=[("blocks.0.attn.hook_z", keep), ("blocks.1.hook_resid_mid", keep)]
    )
    logits[:, -1].sum().backward()
    bridge.zero_grad(set_to_none=True)
    z = kept["blocks.0.attn.hook_z"] if "blocks.0.attn.hook_z" in kept else kept["blocks.0.attn.o.hook_in"]
    mid = kept.get("blocks.1.hook_resid_mid", kept.get("blocks.1.ln2.hook_in"))
    assert got["blocks.0.attn.z"].shape == z.shape == (2, 7, bridge.cfg.n_heads, bridge.cfg.d_head)
    torch.testing.assert_close(got["blocks.0.attn.z"], z.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got["blocks.1.resid_mid"], mid.grad, atol=1e-6, rtol=1e-5)
    assert hooks_on(bridge) == before
