"""A capture that stops early builds no key/value cache (bench/RESULTS.md, capture b: the cache of a
stopped pass is pure waste, +58% peak memory for nnsight's stop on a GPT-2-small shape)."""

from __future__ import annotations

import pytest
import torch
from transformers import cache_utils

import hookscope as hs


@pytest.fixture
def caches_built(monkeypatch) -> list[object]:
    """Every transformers DynamicCache created while the test runs (the cache a decoder builds for
    itself when `use_cache` is on)."""
    built: list[object] = []
    original = cache_utils.DynamicCache.__init__

    def spy(self, *args, **kwargs):
        built.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(cache_utils.DynamicCache, "__init__", spy)
    return built


@pytest.mark.parametrize("key", ["gpt2", "llama"])
def test_stopped_pass_builds_no_kv_cache(tiny, make_ids, caches_built, key):
    model = tiny[key].model
    assert model.config.use_cache  # the decoder would build one by default
    ids = make_ids(model, batch=2, length=6)
    seen_kwargs = []
    spy = model.register_forward_pre_hook(
        lambda m, args, kwargs: seen_kwargs.append(dict(kwargs)), with_kwargs=True
    )
    try:
        with torch.no_grad():  # the spy sees a plain forward build one: it can tell
            model(ids)
        assert len(caches_built) == 1
        caches_built.clear()
        seen_kwargs.clear()

        acts = hs.collect(model, ids, "blocks.0.resid_post")  # stops after block 0 of 3
        assert caches_built == [] and seen_kwargs[-1].get("use_cache") is False

        # the same capture without the stop runs the whole model, which then builds its cache
        with hs.capture(model, "blocks.0.resid_post", stop=False) as cap, torch.no_grad():
            output = model(ids)
        assert len(caches_built) == 1 and output.past_key_values is not None
        assert torch.equal(cap["blocks.0.resid_post"], acts["blocks.0.resid_post"])
    finally:
        spy.remove()
