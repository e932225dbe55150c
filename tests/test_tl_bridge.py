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
3.9); elsewhere it skips, saying why. With HOOKSCOPE_REQUIRE_TL=4 (set by scripts/test-all) a
missing TransformerLens 4 is a failure, never a silent skip.
"""

from __future__ import annotations

import importlib.metadata
import os

import pytest
import torch

import hookscope as hs
from hookscope.hooks import hook_count


def _tl_version() -> str | None:
    try:
        return importlib.metadata.version("transformer-lens")
    except importlib.metadata.PackageNotFoundError:
        return None


TL_VERSION = _tl_version()
if os.environ.get("HOOKSCOPE_REQUIRE_TL") == "4":
    import transformer_lens

    assert TL_VERSION is not None and TL_VERSION.startswith("4."), (
        f"the tl4 test environment must have TransformerLens 4.x, found {TL_VERSION}")
    assert transformer_lens.__file__
elif TL_VERSION is None or not TL_VERSION.startswith("4."):
    pytest.skip(f"needs TransformerLens 4.x (TransformerBridge); this environment has "
                f"{TL_VERSION or 'no TransformerLens'}: run `scripts/test-all tl4`", allow_module_level=True)

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
        out[key] = TransformerBridge.boot_transformers(path, hf_model=hf, tokenizer=tokenizer,
                                                       device="cpu").eval()
    return out


@pytest.fixture(scope="module")
def hf_models(tiny_dirs) -> dict[str, torch.nn.Module]:
    """The same weights as plain Hugging Face models (eager attention, as the bridge forces)."""
    return {key: AutoModelForCausalLM.from_pretrained(str(tiny_dirs[key]), attn_implementation="eager").eval()
            for key in FAMILIES}


def ids_for(bridge, batch: int = 2, length: int = 7, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, bridge.cfg.d_vocab, (batch, length), generator=g)


def test_environment_is_tl4():
    import transformer_lens

    assert TL_VERSION.startswith("4.")
    assert hasattr(transformer_lens, "model_bridge")


# --- every point the bridge caches, under the same name, same tensor, same shape --------------


@pytest.mark.parametrize("key", FAMILIES)
def test_every_point_equals_run_with_cache(bridges, key):
    bridge = bridges[key]
    ids = ids_for(bridge)
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(ids)
    arch = hs.arch_of(bridge)
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
    assert hook_count(bridge) == 0


@pytest.mark.parametrize("key", FAMILIES)
def test_points_lists_true_shapes(bridges, key):
    bridge = bridges[key]
    ids = ids_for(bridge, batch=2, length=5)
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids)
    arch = hs.arch_of(bridge)
    infos = hs.points(bridge, ids)
    assert [i.name for i in infos] == arch.names
    for info in infos:
        assert info.shape is not None, f"{info.name} is listed but did not fire"
        if info.name != "logits":
            assert info.shape == tuple(cache[info.name if info.name in cache else
                                             next(k for k in cache.keys() if arch.spec(k).name == info.name)
                                             ].shape), info.name
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
    arch = hs.arch_of(bridge)
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


def test_mlp_in_spellings_do_not_collide(bridges):
    """`blocks.0.hook_mlp_in` (TransformerLens: the residual before ln2, behind use_hook_mlp_in)
    and `blocks.0.mlp.hook_in` (the MLP's input, after ln2) are two HookPoints, two points."""
    bridge = bridges["gpt2"]
    ids = ids_for(bridge)
    arch = hs.arch_of(bridge)
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids)
    got = hs.collect(bridge, ids, "blocks.0.mlp.hook_in")[arch.spec("blocks.0.mlp.hook_in").name]
    assert torch.equal(got, cache["blocks.0.mlp.hook_in"])
    assert arch.spec("blocks.0.mlp.in") is not arch.spec("blocks.0.mlp.hook_in")
    with pytest.raises(hs.UnknownPointError, match=r"set_use_hook_mlp_in\(True\)"):
        hs.collect(bridge, ids, "blocks.0.hook_mlp_in")
    assert "blocks.0.mlp.in" not in arch.names  # listed only when it fires
    bridge.set_use_hook_mlp_in(True)
    try:
        with torch.no_grad():
            _, cache = bridge.run_with_cache(ids)
        got = hs.collect(bridge, ids, "blocks.0.hook_mlp_in")["blocks.0.mlp.in"]
        assert torch.equal(got, cache["blocks.0.hook_mlp_in"])
        assert torch.equal(got, cache["blocks.0.hook_resid_mid"])  # pre-ln2, as in TransformerLens 3
    finally:
        bridge.set_use_hook_mlp_in(False)
    assert hook_count(bridge) == 0


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
    arch = hs.arch_of(bridge)
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
    assert hook_count(bridge) == 0


def test_optional_points_stay_out_of_patterns(bridges):
    bridge = bridges["gpt2"]
    arch = hs.arch_of(bridge)
    assert "blocks.0.attn.result" in arch.optional
    assert "blocks.0.attn.result" not in [s.name for s in arch.resolve("blocks.0.attn.*")]
    assert tl_bridge.optional_points(bridge)["blocks.0.attn.result"] == "bridge.set_use_attn_result(True)"
