"""hs.generate under the compile policy `blocks` (one small test: compiling is slow on 2 cores).
It uses dynamo's "eager" backend, as most of tests/core/test_compile.py does: dynamo traces the hooks
inside each block, guards and recompiles exactly as under inductor, but generates no code
(inductor took ~10 min here on a loaded machine).

`blocks` turns `config.use_cache` off (a plain forward's cache is waste there); generate reads
its own `generation_config.use_cache`, so it still decodes with the KV cache. Checked here: the
tokens, captures and steering equal those of the same weights run eagerly, and no hook stays."""

from __future__ import annotations

import copy

import pytest
import torch

import hookscope as hs
from hookscope.compiling import compile_model, compile_stats, reset_stats
from hookscope.hooks import hook_count
from hookscope.testing import build_tiny


@pytest.fixture
def fresh_dynamo():
    # saved and set back by hand: monkeypatch's undo deletes the attribute (it is not in the
    # config module's __dict__), which hides the setting and makes the next read raise
    torch._dynamo.reset()
    saved = torch._dynamo.config.skip_nnmodule_hook_guards
    yield
    torch._dynamo.config.skip_nnmodule_hook_guards = saved
    torch._dynamo.reset()


@pytest.mark.slow
def test_generate_under_blocks_equals_eager(fresh_dynamo):
    eager = build_tiny("gpt2", n_layers=2, d_model=32, n_heads=4, seed=5)
    compiled = compile_model(copy.deepcopy(eager), "blocks", backend="eager")
    reset_stats()
    assert compiled.config.use_cache is False  # what `blocks` does today ...
    inputs = {
        "input_ids": torch.tensor([[1, 1, 7, 42, 99], [5, 17, 300, 8, 61]]),
        "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]),
    }
    vector = torch.randn(32, generator=torch.Generator().manual_seed(0)) * 6
    points = ["blocks.0.resid_post", "blocks.1.attn.z", "blocks.1.resid_post"]
    opts = dict(max_new_tokens=5, do_sample=False, pad_token_id=1)
    before = hook_count(compiled)
    results = []
    for model in (eager, compiled):
        results.append(
            hs.generate(
                model,
                inputs,
                points,
                edits=[hs.steer("blocks.0.mlp.out", vector)],
                edit_on="generated",
                **opts,
            )
        )
    want, got = results
    assert hook_count(compiled) == before
    stats = compile_stats()
    assert stats["frames_compiled"] > 0 and stats["frames_failed"] == 0, stats  # it really ran compiled
    assert torch.equal(got.sequences, want.sequences)
    assert not torch.equal(want.sequences, eager.generate(**inputs, **opts))  # the steering matters
    for point in points:
        torch.testing.assert_close(got[point][want.mask], want[point][want.mask], atol=1e-5, rtol=1e-4)
    # ... and generate still ran with the KV cache: one forward pass per new token, the first on
    # the whole prompt (the generation config, not the model config, decides)
    lengths = []
    handle = compiled.register_forward_pre_hook(
        lambda m, a, k: lengths.append(k["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        compiled.generate(**inputs, **opts)
    finally:
        handle.remove()
    assert lengths == [5, 1, 1, 1, 1]


@pytest.mark.slow
def test_patch_under_blocks_equals_eager(fresh_dynamo):
    """A patch during generation reads its source at the positions each pass covers (a new slice
    every step): under `blocks` it gives the tokens and captures of the same patch run eagerly, on
    the prompt (the whole prompt pass patched) and at chosen sequence positions (one step patched,
    the others left alone), and both differ from generating without it."""
    eager = build_tiny("gpt2", n_layers=2, d_model=32, n_heads=4, seed=6)
    compiled = compile_model(copy.deepcopy(eager), "blocks", backend="eager")
    reset_stats()
    inputs = {
        "input_ids": torch.tensor([[1, 1, 7, 42, 99], [5, 17, 300, 8, 61]]),
        "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]),
    }
    opts = dict(max_new_tokens=5, do_sample=False, pad_token_id=1)
    # the source: block 0's output over another run's whole final sequence (prompt + 5 new tokens)
    other = hs.generate(
        eager,
        {
            "input_ids": torch.tensor([[1, 1, 300, 2, 9], [44, 3, 8, 8, 150]]),
            "attention_mask": inputs["attention_mask"],
        },
        "blocks.0.resid_post",
        **opts,
    )
    source = other["blocks.0.resid_post"] * 4
    points = ["blocks.0.resid_post", "blocks.1.resid_post"]
    plain = eager.generate(**inputs, **opts)
    before = hook_count(compiled)
    for edit, edit_on in [
        (hs.patch("blocks.0.resid_post", source), "prompt"),
        (hs.patch("blocks.0.resid_post", source, positions=[6]), "both"),
    ]:
        want, got = (
            hs.generate(model, inputs, points, edits=[edit], edit_on=edit_on, **opts)
            for model in (eager, compiled)
        )
        assert torch.equal(got.sequences, want.sequences)
        assert not torch.equal(want.sequences, plain)  # the patch matters
        for point in points:
            torch.testing.assert_close(got[point][want.mask], want[point][want.mask], atol=1e-5, rtol=1e-4)
        patched = [6] if edit_on == "both" else list(range(5))
        torch.testing.assert_close(got["blocks.0.resid_post"][:, patched], source[:, patched])
    assert hook_count(compiled) == before
    stats = compile_stats()
    assert stats["frames_compiled"] > 0 and stats["frames_failed"] == 0, stats
