"""One way to run a model until a point (stopping.py), and each of its users stopping there.

The reference is always a plain `register_forward_hook` written here on a module after the stop:
it must never fire; the values kept before the stop are compared with a plain hook on a whole
forward pass."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope.loading import streamer_for
from hookscope.loading.partial_load import prologue_modules
from hookscope.sources.images import _first_block_tokens
from hookscope.stopping import ForwardStopped, Stop
from hookscope.testing import build_tiny, save_tiny

IDS = torch.tensor([[5, 9, 2, 7, 1, 3, 8, 4], [2, 2, 6, 1, 9, 7, 3, 5]])


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return save_tiny("gpt2", tmp_path_factory.mktemp("stop") / "gpt2", n_layers=4, d_model=32, n_heads=4)


def fired(module: nn.Module) -> tuple[list[int], object]:
    """A plain forward hook counting the calls of `module`, and its handle."""
    calls: list[int] = []
    return calls, module.register_forward_hook(lambda *_: calls.append(1))


def first(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def whole_pass_output(model: nn.Module, path: str, inputs) -> torch.Tensor:
    got = []
    handle = model.get_submodule(path).register_forward_hook(lambda _m, _a, out: got.append(first(out)))
    with torch.inference_mode():
        model(**inputs) if isinstance(inputs, dict) else model(inputs)
    handle.remove()
    return got[0]


def test_a_stop_after_a_block_ends_the_pass_there_and_keeps_what_it_saw(gpt2_dir):
    model = hs.load(str(gpt2_dir), tokenizer=False).model
    want = whole_pass_output(model, "transformer.h.1", IDS)
    stop, seen = Stop(), []
    later, handle = fired(model.transformer.h[2])
    stopping = stop.after(model.transformer.h[1], lambda out: seen.append(first(out)))
    with torch.inference_mode():
        output, stopped = stop.run(model, IDS)
    stopping.remove(), handle.remove()
    assert (output, stopped, later) == (None, True, [])
    assert torch.equal(seen[0], want)
    with torch.inference_mode():  # the hook removed: the whole pass runs and returns its output
        output, stopped = stop.run(model, IDS)
    assert not stopped and output.logits.shape == (2, 8, model.config.vocab_size)


def test_model_code_catching_exception_cannot_swallow_a_stop():
    class Careless(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.then = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x):
            try:
                x = self.first(x)
            except Exception:  # a model that "recovers" from anything
                pass
            return self.then(x)

    model, stop = Careless(), Stop()
    later, handle = fired(model.then)
    stop.before(model.first)
    assert stop.run(model, torch.ones(1, 3)) == (None, True) and later == []


def test_a_stop_passes_through_another_stops_run_to_its_own(gpt2_dir):
    """The stop of an outer pass (a capture's) raised inside an inner `run` (a profiled step's) is not
    caught there: each stop ends only its own pass."""
    model = hs.load(str(gpt2_dir), tokenizer=False).model
    outer, inner = Stop(), Stop()
    handle = outer.after(model.transformer.h[0])
    with pytest.raises(ForwardStopped) as raised, torch.inference_mode():
        inner.run(model, IDS)
    handle.remove()
    assert outer.ended(raised.value) and not inner.ended(raised.value)


def test_capture_stops_after_the_last_point(gpt2_dir):
    model = hs.load(str(gpt2_dir), tokenizer=False).model
    want = whole_pass_output(model, "transformer.h.1", IDS)
    later, handle = fired(model.transformer.h[2])
    got = hs.collect(model, IDS, "blocks.1.resid_post")["blocks.1.resid_post"]
    with hs.capture(model, "blocks.1.resid_post", stop=True) as cap:  # the `with` body ends quietly
        model(IDS)
        raise AssertionError("the pass should have stopped")
    handle.remove()
    assert later == [] and torch.equal(got, want) and torch.equal(cap["blocks.1.resid_post"], want)


def test_block_streaming_stops_each_pass_after_its_block(gpt2_dir):
    """Points in blocks 0 and 1: the pass for block 0 ends after block 0 (block 1's own module is
    not called then), the pass for block 1 ends after it (block 2 never runs)."""
    loaded = hs.load(str(gpt2_dir), device="meta", tokenizer=False)
    points = ["blocks.0.resid_post", "blocks.1.resid_post"]
    streamer = streamer_for(loaded, points, 10**9, batch_size=2, context=8, dtype=torch.float32)
    blocks = loaded.model.transformer.h
    counted = [fired(blocks[k]) for k in range(3)] + [fired(loaded.model.transformer.ln_f)]
    try:
        acts = streamer.run_chunk([{"input_ids": IDS, "attention_mask": torch.ones_like(IDS)}], [None])
    finally:
        streamer.close()
        for _, handle in counted:
            handle.remove()
    assert [len(calls) for calls, _ in counted] == [1, 1, 0, 0]
    whole = hs.load(str(gpt2_dir), tokenizer=False).model
    for k, point in enumerate(points):
        want = whole_pass_output(whole, f"transformer.h.{k}", IDS)
        assert torch.equal(acts[0][point], want)


def test_profiling_a_points_model_stops_where_its_weights_end(gpt2_dir):
    model = hs.load(str(gpt2_dir), tokenizer=False, points=["blocks.1.resid_post"]).model
    later, handle = fired(model.transformer.h[2])
    report = hs.profile(model, IDS, steps=2, warmup=1)
    handle.remove()
    assert later == [] and report is not None


def test_the_image_source_counts_tokens_at_the_first_block(tmp_path):
    model = build_tiny("vit", n_layers=2)
    pixels = torch.randn(2, 3, 32, 32)
    first = "layers.0"
    # the first block's input is what the embeddings give
    want = whole_pass_output(model, "embeddings", {"pixel_values": pixels}).shape[1]
    calls, handle = fired(model.get_submodule(first))
    tokens = _first_block_tokens(model, first, pixels, "cpu")
    handle.remove()
    assert calls == [] and tokens == want == 16 + 1  # a 4 x 4 grid of patches and the class token


def test_a_points_load_finds_the_modules_before_the_first_block():
    later: list[int] = []

    def meta_model() -> nn.Module:
        with torch.device("meta"):
            model = build_tiny("gpt2", n_layers=2)
        model.transformer.h[0].attn.register_forward_hook(lambda *_: later.append(1))
        return model

    found = prologue_modules(meta_model, "transformer.h.0")
    assert later == []
    assert {"", "transformer", "transformer.wte", "transformer.wpe", "transformer.h.0"} <= found
    assert not {"transformer.h.0.attn", "transformer.h.1", "transformer.ln_f", "lm_head"} & found


def test_a_captures_stop_inside_another_pass_ends_its_own_with_block(gpt2_dir):
    """`with hs.capture(..., stop=True)` around `hs.collect` of a later point: the outer capture's
    stop, raised in the collect's pass, is not taken for the collect's own; it ends the `with` body."""
    model = hs.load(str(gpt2_dir), tokenizer=False).model
    want = whole_pass_output(model, "transformer.h.0", IDS)
    later, handle = fired(model.transformer.h[1])
    after_collect = []
    with hs.capture(model, "blocks.0.resid_post", stop=True) as outer:
        hs.collect(model, IDS, "blocks.2.resid_post")
        after_collect.append(1)
    handle.remove()
    assert (later, after_collect) == ([], []) and torch.equal(outer["blocks.0.resid_post"], want)
