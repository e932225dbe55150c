"""State-space / recurrent families (arch/mamba.py, rwkv.py) on tiny random-init models saved to
disk (the pure-torch paths, as on any CPU): every point equals a plain register_forward_hook on
a module path written by hand in family_paths.py (never read from the table under test), the
residual stream equals output_hidden_states, and early stop skips later blocks."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from family_paths import reference, ssm_paths
from helpers import token_ids

import hookscope as hs
from hookscope.arch import arch_of
from hookscope.testing import SSM_FAMILIES, save_tiny

N_LAYERS = 3


@pytest.fixture(scope="module", params=SSM_FAMILIES)
def ssm(request, tmp_path_factory):
    path = save_tiny(
        request.param, tmp_path_factory.mktemp(request.param), n_layers=N_LAYERS, d_model=32, vocab_size=300
    )
    return request.param, hs.load(str(path)).model


_ids = partial(token_ids, length=9, low=0)


def test_every_point_equals_a_forward_hook(ssm):
    family, model = ssm
    arch = arch_of(model)
    assert arch.family == family and arch.n_layers == N_LAYERS
    assert {"blocks.2.mixer.in", "blocks.2.mixer.out", "blocks.2.resid_post"} <= set(arch.names)
    ids = _ids(model)
    got = reference(model, ssm_paths(model), {"input_ids": ids, "use_cache": False})
    acts = hs.collect(model, ids, arch.names)
    assert set(acts) == set(got) == set(arch.names)
    for name, expect in got.items():
        assert torch.equal(acts[name], expect), name
    assert acts["blocks.1.mixer.out"].shape == (2, 9, 32)


def test_residual_stream_equals_hidden_states(ssm):
    """An independent reference: the model's own output_hidden_states (block L's output)."""
    family, model = ssm
    ids = _ids(model, seed=1)
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True, use_cache=False).hidden_states
    acts = hs.collect(model, ids, ["blocks.*.resid_post", "ln_final"])
    assert len(hidden) == N_LAYERS + 1
    for layer in range(N_LAYERS):
        assert torch.equal(acts[f"blocks.{layer}.resid_post"], hidden[layer]), layer
    assert torch.equal(acts["ln_final"], hidden[-1])


def test_mixer_out_is_what_the_block_adds(ssm):
    family, model = ssm
    after = "blocks.1.resid_mid" if family == "rwkv" else "blocks.1.resid_post"
    acts = hs.collect(model, _ids(model, seed=2), ["blocks.1.resid_pre", "blocks.1.mixer.out", after])
    after = acts[after]
    torch.testing.assert_close(acts["blocks.1.resid_pre"] + acts["blocks.1.mixer.out"], after)


def test_early_stop_skips_later_blocks(ssm):
    family, model = ssm
    arch = arch_of(model)
    blocks = [model.get_submodule(p) for p in arch.block_paths]
    calls = [0] * N_LAYERS
    handles = [
        b.register_forward_pre_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, b in enumerate(blocks)
    ]
    try:
        acts = hs.collect(model, _ids(model), ["blocks.1.mixer.out", "blocks.0.mixer.in"])
    finally:
        for h in handles:
            h.remove()
    assert calls == [1, 1, 0]
    assert acts["blocks.0.mixer.in"].shape == (2, 9, 32)


def test_steer_the_mixer_output(ssm):
    """Edits use the same names: adding a vector to mixer.out shifts the residual by it."""
    family, model = ssm
    ids = _ids(model, seed=3)
    vector = torch.randn(32, generator=torch.Generator().manual_seed(0))
    clean = hs.collect(model, ids, "blocks.0.mixer.out")["blocks.0.mixer.out"]
    with hs.edit(model, hs.steer("blocks.0.mixer.out", vector)):
        steered = hs.collect(model, ids, "blocks.0.mixer.out")["blocks.0.mixer.out"]
    torch.testing.assert_close(steered, clean + vector)
