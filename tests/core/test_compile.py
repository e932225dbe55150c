"""Compile policy: how it is chosen, that `off` never compiles, and that captures, gradients and
edits under `blocks` / `full` equal the same calls on the eager model (references taken before
compiling), with no graph break and no recompile for a repeated capture.

Each test builds its own 2-layer, d_model 32 model: compiling changes a model in place. Most use
the "eager" backend (dynamo traces, guards, hooks and graph breaks exactly as with inductor, but
generates no code, so it takes a second); `test_captures_equal_eager_under_inductor` runs inductor.
"""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch
from helpers import token_ids

import hookscope as hs
from hookscope import compiling as hc
from hookscope.hooks import hook_count
from hookscope.testing import build_tiny

pytestmark = pytest.mark.slow  # most tests here compile a model (dynamo, inductor): 60 s of the suite

FAST = "eager"  # dynamo without code generation


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch):
    """Each test starts with empty dynamo caches and counters, its own warn-once memory, and
    leaves torch's global hook-guard setting as it found it."""
    monkeypatch.setattr(hc, "_WARNED", set())
    monkeypatch.delenv(hc.ENV_VAR, raising=False)
    torch._dynamo.reset()
    hc.reset_stats()
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=torch._dynamo.config.skip_nnmodule_hook_guards):
        yield
    torch._dynamo.reset()


def tiny(family: str) -> torch.nn.Module:
    return build_tiny(family, d_model=32, n_layers=2, n_heads=4, context=32)


ids_for = partial(token_ids, length=8)


def assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        torch.testing.assert_close(got[name], value, msg=name)


# --- choosing the policy --------------------------------------------------------------------


def test_policy_defaults_to_off_env_selects_argument_wins(monkeypatch):
    assert hc.resolve_policy() == "off"
    monkeypatch.setenv(hc.ENV_VAR, "blocks")
    assert hc.resolve_policy() == "blocks"
    assert hc.resolve_policy("full") == "full"
    assert hc.resolve_policy("off") == "off"
    assert hc.resolve_policy(" Full ") == "full"


@pytest.mark.parametrize("where", ["argument", "env"])
def test_bad_policy_names_the_valid_ones(monkeypatch, where):
    if where == "env":
        monkeypatch.setenv(hc.ENV_VAR, "everything")
    with pytest.raises(hs.HookscopeError, match="off, blocks, full") as err:
        hc.resolve_policy("everything" if where == "argument" else None)
    assert (hc.ENV_VAR in str(err.value)) == (where == "env")


def recording_compile(monkeypatch) -> list:
    """Replace torch.compile with a recorder that returns the function uncompiled."""
    calls: list = []

    def fake_compile(fn, **options):
        calls.append((fn, options))
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    return calls


def test_off_never_calls_torch_compile(monkeypatch):
    calls = recording_compile(monkeypatch)
    model = tiny("gpt2")
    ids = ids_for(model)
    want = hs.collect(model, ids, "blocks.1.attn.q")
    monkeypatch.setenv(hc.ENV_VAR, "off")
    assert hc.compile_model(model) is model
    monkeypatch.setenv(hc.ENV_VAR, "full")
    assert hc.compile_model(model, "off") is model  # the argument wins over the environment
    assert calls == []
    assert hc.policy_of(model) == "off"
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert_same(hs.collect(model, ids, "blocks.1.attn.q"), want)


def test_env_var_selects_blocks_one_compile_call_for_all_layers(monkeypatch):
    calls = recording_compile(monkeypatch)
    model = tiny("llama")
    monkeypatch.setenv(hc.ENV_VAR, "blocks")
    hc.compile_model(model, mode="max-autotune-no-cudagraphs", dynamic=False)
    layers = model.model.layers
    assert hc.policy_of(model) == "blocks"
    assert len(calls) == 1  # one torch.compile serves every layer
    fn, options = calls[0]
    assert fn is type(layers[0]).forward
    assert options["mode"] == "max-autotune-no-cudagraphs" and options["dynamic"] is False
    assert all(layer.forward.__func__ is fn and layer.forward.__self__ is layer for layer in layers)
    assert model.config.use_cache is False
    assert hc.region_of(model, "model.layers.1.mlp.down_proj") == "model.layers.1"
    assert hc.region_of(model, "model.layers.1") is None  # the block's own hooks run eagerly
    assert hc.region_of(model, "model.embed_tokens") is None


def test_apply_is_idempotent_and_refuses_a_second_policy(monkeypatch):
    calls = recording_compile(monkeypatch)
    model = tiny("gpt2")
    hc.compile_model(model, "full")
    hc.compile_model(model, "full")
    assert len(calls) == 1
    assert hc.region_of(model, "transformer.h.0.mlp") == "" and hc.region_of(model, "") is None
    with pytest.raises(hs.HookscopeError, match="already compiled with policy 'full'"):
        hc.compile_model(model, "blocks")


def test_a_torch_without_the_recompile_limit_option_gets_the_global_limit_raised(monkeypatch):
    """torch 2.11 (the GPU machines' build) has no `recompile_limit=` on torch.compile: passing it
    there was a TypeError on every compile; the limit then goes through dynamo's global setting."""
    real_compile = torch.compile

    def compile_of_torch_2_11(
        model=None,
        *,
        fullgraph=False,
        dynamic=None,
        backend="inductor",
        mode=None,
        options=None,
        disable=False,
    ):
        return real_compile(
            model,
            fullgraph=fullgraph,
            dynamic=dynamic,
            backend=backend,
            mode=mode,
            options=options,
            disable=disable,
        )

    monkeypatch.setattr(torch, "compile", compile_of_torch_2_11)
    model = tiny("gpt2")
    ids = ids_for(model)
    want = hs.collect(model, ids, "blocks.1.resid_post")
    with torch._dynamo.config.patch(recompile_limit=8):
        hc.compile_model(model, "blocks", backend=FAST)
        assert torch._dynamo.config.recompile_limit == hc.RECOMPILE_LIMIT
        assert_same(hs.collect(model, ids, "blocks.1.resid_post"), want)


def test_blocks_needs_repeated_blocks():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with pytest.raises(hs.HookscopeError, match="no repeated blocks"):
        hc.compile_model(model, "blocks", backend=FAST)


# --- captures, gradients, edits equal eager -------------------------------------------------

# (points, options): points inside a block (traced), on the block itself (eager), outside
# blocks, with static and tensor selections, a cast, a token mask, several layers at once.
CASES = [
    ("blocks.1.resid_post", {}),
    ("blocks.0.attn.q", {"positions": -1, "heads": [1, 2]}),
    ("blocks.1.mlp.pre", {"positions": [0, -1], "dtype": torch.float16}),
    ("blocks.0.mlp.out", {"positions": torch.tensor([3, 5])}),
    ("blocks.1.attn.k", {"heads": torch.tensor([0])}),
    ("blocks.0.resid_mid", {"token_mask": torch.arange(16).reshape(2, 8) % 3 == 0}),
    (["embed", "blocks.*.attn.v", "logits"], {"positions": "last"}),
]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("policy", ["blocks", "full"])
def test_captures_equal_eager_without_breaks_or_repeat_recompiles(family, policy):
    model = tiny(family)
    ids = ids_for(model)
    want = [hs.collect(model, ids, points, **opts) for points, opts in CASES]
    hooks_before = hook_count(model)
    hc.compile_model(model, policy, backend=FAST)
    for points, opts in CASES:  # each new set of hooks compiles once ...
        hs.collect(model, ids, points, **opts)
    first = hc.compile_stats()
    assert first["graph_breaks"] == 0 and first["frames_failed"] == 0, first["break_reasons"]
    hc.reset_stats()
    for (points, opts), w in zip(CASES, want, strict=True):  # ... and never again
        assert_same(hs.collect(model, ids, points, **opts), w)
    again = hc.compile_stats()
    assert again["graph_breaks"] == 0 and again["recompiles"] == 0 and again["unique_graphs"] == 0, again
    assert hook_count(model) == hooks_before


def test_one_graph_serves_every_layer_under_blocks():
    model = tiny("gpt2")
    ids = ids_for(model)
    hc.compile_model(model, "blocks", backend=FAST)
    hs.collect(model, ids, "blocks.0.resid_pre")  # the hook-free block graph
    hc.reset_stats()
    hs.collect(model, ids, "blocks.*.attn.z")  # the same traced hook on both layers
    stats = hc.compile_stats()
    assert stats["unique_graphs"] == 1 and stats["graph_breaks"] == 0, stats


# inductor's code differs by family, hookscope's path by policy: each policy on one family by default
# (the other two with --full); the eager backend above runs every family under every policy
@pytest.mark.parametrize(
    ("family", "policy"),
    [
        ("gpt2", "blocks"),
        ("llama", "full"),
        pytest.param("llama", "blocks", marks=pytest.mark.full),
        pytest.param("gpt2", "full", marks=pytest.mark.full),
    ],
)
def test_captures_equal_eager_under_inductor(family, policy):
    model = tiny(family)
    ids = ids_for(model)
    points = ["embed", "blocks.0.attn.q", "blocks.1.mlp.post", "blocks.1.resid_post", "logits"]
    opts = {"positions": [0, -1], "stop": False}
    want = hs.collect(model, ids, points, **opts)
    hc.compile_model(model, policy)
    assert_same(hs.collect(model, ids, points, **opts), want)
    hc.reset_stats()
    assert_same(hs.collect(model, ids, points, **opts), want)
    stats = hc.compile_stats()
    assert stats["graph_breaks"] == 0 and stats["recompiles"] == 0, stats


def test_capture_stops_after_the_block_of_the_last_point_under_blocks():
    model = tiny("gpt2")
    ids = ids_for(model)
    hc.compile_model(model, "blocks", backend=FAST)
    later = {"calls": 0}

    def count(module, args):
        later["calls"] += 1

    handle = model.transformer.h[1].register_forward_pre_hook(count)
    try:
        got = hs.collect(model, ids, "blocks.0.mlp.pre")
        assert later["calls"] == 0  # block 1 never ran
        with hs.capture(model, "blocks.0.mlp.pre") as cap:
            model(ids)  # a plain pass inside `with`: no stop
        assert later["calls"] == 1
        torch.testing.assert_close(cap["blocks.0.mlp.pre"], got["blocks.0.mlp.pre"])
    finally:
        handle.remove()
    assert hc.compile_stats()["graph_breaks"] == 0


def loss_fn(output) -> torch.Tensor:
    return output.logits[:, -1].logsumexp(-1).sum()


def test_gradients_under_blocks_equal_eager():
    model = tiny("gpt2")
    ids = ids_for(model)
    points = ["blocks.0.resid_post", "blocks.1.resid_pre"]  # block boundaries: stay compiled
    want = hs.grads(model, ids, points, loss_fn)
    inner_want = hs.grads(model, ids, "blocks.1.attn.v", loss_fn)
    hc.compile_model(model, "blocks", backend=FAST)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = hs.grads(model, ids, points, loss_fn)
    assert not [w for w in caught if "eagerly" in str(w.message)]  # compiled: no eager fallback
    for name in points:
        torch.testing.assert_close(got[name], want[name])
    assert hc.compile_stats()["graph_breaks"] == 0
    # inside a block, autograd needs the eager tensor: that block runs eagerly, once warned
    compiled = model.transformer.h[1].forward
    with pytest.warns(UserWarning, match="runs that block eagerly"):
        inner = hs.grads(model, ids, "blocks.1.attn.v", loss_fn)
    torch.testing.assert_close(inner["blocks.1.attn.v"], inner_want["blocks.1.attn.v"])
    assert model.transformer.h[1].forward is compiled  # compiled again once the hook is gone


def test_gradient_hook_under_blocks_equals_eager():
    model = tiny("llama")
    ids = ids_for(model)

    def run() -> torch.Tensor:
        kept = {}
        with hs.hooks(model) as h:
            h.grad("blocks.1.attn.q", lambda g, hook: kept.setdefault("g", g.clone()))
            loss_fn(model(ids)).backward()
        model.zero_grad()
        return kept["g"]

    want = run()
    hc.compile_model(model, "blocks", backend=FAST)
    with pytest.warns(UserWarning, match="gradient hook cannot be traced"):
        got = run()
    torch.testing.assert_close(got, want)
    assert hc.compile_stats()["graph_breaks"] == 0


@pytest.mark.parametrize("policy", ["blocks", "full"])
def test_edits_equal_eager(policy):
    model = tiny("gpt2")
    ids, other = ids_for(model, seed=0), ids_for(model, seed=1)
    source = hs.collect(model, other, "blocks.1.mlp.pre")

    def edited() -> torch.Tensor:
        with (
            torch.no_grad(),
            hs.edit(
                model,
                hs.ablate("blocks.0.attn.z", heads=[1]),
                hs.steer("blocks.1.resid_post", torch.linspace(-1, 1, 32), scale=0.5),
                hs.patch("blocks.1.mlp.pre", source, positions=[2, 3]),
            ),
        ):
            return model(ids).logits

    want = edited()
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, want)  # the edits do change the output
    hc.compile_model(model, policy, backend=FAST)
    torch.testing.assert_close(edited(), want)
    hc.reset_stats()
    torch.testing.assert_close(edited(), want)
    stats = hc.compile_stats()
    assert stats["graph_breaks"] == 0 and stats["recompiles"] == 0, stats


# --- what the compiler did ------------------------------------------------------------------


def test_compile_stats_count_breaks_and_graphs():
    def f(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    compiled = torch.compile(f, backend=FAST)
    torch.testing.assert_close(compiled(torch.ones(3)), torch.full((3,), 4.0))
    stats = hc.compile_stats()
    assert stats["graph_breaks"] == 1 and stats["unique_graphs"] == 2 and stats["recompiles"] == 0
    compiled(torch.ones(3, dtype=torch.float64))  # a new dtype: both frames recompile
    assert hc.compile_stats()["recompiles"] == 2
    hc.reset_stats()
    assert hc.compile_stats() == {
        "graph_breaks": 0,
        "break_reasons": {},
        "unique_graphs": 0,
        "frames_compiled": 0,
        "frames_failed": 0,
        "recompiles": 0,
        "recompile_reasons": [],
        "compile_time_s": 0.0,
    }


def test_mega_cache_round_trip(tmp_path):
    compiled = torch.compile(lambda x: torch.sin(x) * 2)
    torch.testing.assert_close(compiled(torch.ones(4)), torch.sin(torch.ones(4)) * 2)
    path = hc.save_cache(tmp_path / "compile.bin")
    assert path is not None and path.stat().st_size > 0
    assert hc.load_cache(path)
    with pytest.raises(hs.HookscopeError, match="no compile cache"):
        hc.load_cache(tmp_path / "missing.bin")
