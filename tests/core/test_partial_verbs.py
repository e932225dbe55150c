"""Every verb on a model loaded with `points=` (issue 29): it runs as far as the weights go, or
refuses up front with the error that names the load, never a meta-tensor error from inside torch.

References are independent of hookscope: a plain `from_pretrained` of the whole model with a bare
`register_forward_hook` on a block path written here, and bare hooks counting which modules ran.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_partial_load import hooked_output, inputs_for, plain_model
from torch import nn

import hookscope as hs
from hookscope.errors import PointNotLoadedError
from hookscope.hooks import hook_count
from hookscope.testing import save_tiny

SIZE = {"d_model": 64, "n_layers": 3, "n_heads": 4, "context": 64}
LOADED_FOR = "blocks.1.resid_post"  # blocks 0 and 1 of 3: block 2, the final norm and the head stay on meta


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return save_tiny("llama", tmp_path_factory.mktemp("partial-verbs") / "llama", **SIZE)


@pytest.fixture
def part(llama_dir) -> nn.Module:
    return hs.load(str(llama_dir), tokenizer=False, points=[LOADED_FOR]).model


def calls_per_block(model: nn.Module) -> tuple[list[int], list]:
    """Bare forward hooks counting each block's calls (paths written from the module tree)."""
    counts = [0, 0, 0]

    def counter(index: int):
        def count(*_):
            counts[index] += 1

        return count

    blocks = [model.get_submodule(f"model.layers.{i}") for i in range(3)]
    return counts, [block.register_forward_hook(counter(i)) for i, block in enumerate(blocks)]


def test_profile_runs_the_loaded_blocks_and_says_what_was_left_out(llama_dir, part):
    full = plain_model(llama_dir)
    ids = inputs_for("llama")["input_ids"]
    counts, handles = calls_per_block(part)
    given = []

    def loss_fn(hidden: torch.Tensor) -> torch.Tensor:
        given.append(hidden.detach().clone())
        return hidden.float().mean()

    try:
        report = hs.profile(part, ids, steps=2, warmup=1, backward=True, loss_fn=loss_fn)
    finally:
        for handle in handles:
            handle.remove()
    assert counts[0] == counts[1] > 0 and counts[2] == 0  # every step stopped where the weights end
    # rows for the loaded blocks only, forward then backward in the order backward runs them
    assert [(r.name, r.kind) for r in report.block_rows()] == [
        ("blocks.0", "block"),
        ("blocks.1", "block"),
        ("blocks.1", "block backward"),
        ("blocks.0", "block backward"),
    ]
    # loss_fn got the hidden state where the weights end: block 1's output
    want = hooked_output(full, "model.layers.1", {"input_ids": ids})
    assert given and all(torch.equal(h, want) for h in given)
    assert report.not_loaded is not None and "block 2 of 3" in report.not_loaded
    assert "not profiled: block 2 of 3" in report.summary()
    assert "blocks 0-1 of 3" in report.not_loaded and "points=['blocks.1.resid_post']" in report.not_loaded
    assert hook_count(part) == 1  # only the load's guard is left


def test_profile_of_the_whole_model_says_nothing_was_left_out(llama_dir):
    whole = hs.load(str(llama_dir), tokenizer=False, points=["logits"]).model
    report = hs.profile(whole, inputs_for("llama")["input_ids"], steps=1, warmup=0)
    assert report.not_loaded is None and "not profiled" not in report.summary()
    assert [r.name for r in report.block_rows()] == ["blocks.0", "blocks.1", "blocks.2"]


def test_points_measures_the_shapes_the_weights_reach(llama_dir, part):
    full = plain_model(llama_dir)
    ids = inputs_for("llama")["input_ids"]
    shapes = {info.name: info.shape for info in hs.points(part, ids)}
    want = hooked_output(full, "model.layers.1", {"input_ids": ids})
    assert shapes["blocks.1.resid_post"] == tuple(want.shape)
    assert shapes["blocks.0.attn.q"] == (2, 7, 4, 16)
    assert shapes["blocks.2.resid_pre"] is None and shapes["logits"] is None
    assert set(shapes) == {info.name for info in hs.points(full)}  # every point listed, measured or not


def test_verbs_that_need_the_output_refuse_before_anything_runs(part):
    ids = inputs_for("llama")["input_ids"]
    counts, handles = calls_per_block(part)
    verbs = {
        "hs.collect": lambda: hs.collect(part, ids, "logits"),
        "hs.grads": lambda: hs.grads(part, ids, "blocks.0.resid_post", lambda out: out.logits.sum()),
        "hs.generate": lambda: hs.generate(part, ids, "blocks.0.resid_post", max_new_tokens=2),
    }
    try:
        for verb, call in verbs.items():
            with pytest.raises(PointNotLoadedError) as info:
                call()
            message = str(info.value)
            assert f"points=['{LOADED_FOR}']" in message and "blocks 0-1 of 3" in message, verb
            assert "without points=" in message, verb
    finally:
        for handle in handles:
            handle.remove()
    assert counts == [0, 0, 0]
    assert hook_count(part) == 1


def test_an_edit_over_a_whole_pass_meets_the_guard(part):
    """An edit does not stop the pass: the model's own forward reaches block 2, and the error is
    hookscope's, naming it."""
    ids = inputs_for("llama")["input_ids"]
    with pytest.raises(PointNotLoadedError, match="reached model.layers.2"):
        with hs.edit(part, hs.ablate("blocks.0.resid_post")):
            part(ids)
    assert hook_count(part) == 1
