"""Writes at `blocks.L.resid_mid` change the residual stream, as TransformerLens's do: the stream
that both the MLP and the block's skip connection read. Hugging Face blocks read resid_mid at ln2's
input but keep their own reference for the skip, so a write there alone changed only what the MLP
read. The reference here is written by hand: a plain `register_forward_hook` on the module whose
output the block adds to the stream after attention (module paths below, from the models' module
trees), with resid_pre from a plain pre-hook on the block: resid_mid = resid_pre + that output.
Compared on the model's output (logits, or the encoder's last hidden state), in float32."""

from __future__ import annotations

import copy

import pytest
import torch
from family_models import build, inputs
from torch import nn

import hookscope as hs

ATOL = 1e-4  # float32, random tiny models whose outputs are of order 1..10

# case -> (block path, module whose output attention adds to the stream), {L} the layer
_POST_NORMED = "model.layers.{L}.post_attention_layernorm"
PATHS = {
    "gpt2": ("transformer.h.{L}", "transformer.h.{L}.attn"),
    "llama": ("model.layers.{L}", "model.layers.{L}.self_attn"),
    **{c: ("model.layers.{L}", "model.layers.{L}.self_attn") for c in ("mistral", "qwen2", "qwen3", "gemma")},
    "olmo": ("model.layers.{L}", "model.layers.{L}.self_attn"),
    # sandwich / post norms: what is added is the post-attention norm's output
    **{c: ("model.layers.{L}", _POST_NORMED) for c in ("gemma2", "gemma3_text", "olmo2")},
    **{
        c: ("model.layers.{L}", "model.layers.{L}.self_attn")
        for c in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
    },
    "neox_sequential": ("gpt_neox.layers.{L}", "gpt_neox.layers.{L}.attention"),
    "vit": ("layers.{L}", "layers.{L}.attention"),
    "clip": ("encoder.layers.{L}", "encoder.layers.{L}.self_attn"),
    "dinov2": ("encoder.layer.{L}", "encoder.layer.{L}.layer_scale1"),
    # block 0 normalises its input first (pre_ln): its block input is not the stream; layer 1 only
    "rwkv": ("rwkv.blocks.{L}", "rwkv.blocks.{L}.attention"),
}
LAYER = 1
FAST = ("llama", "gpt2")


def _model(case: str) -> tuple[nn.Module, dict]:
    model = build(case).float()
    batch = {k: v.float() if v.is_floating_point() else v for k, v in inputs(case).items()}
    return model, batch


def _first(x):
    return x if isinstance(x, torch.Tensor) else x[0]


def _reference(model: nn.Module, batch: dict, case: str, layer: int, new_mid) -> torch.Tensor:
    """The output with attention's contribution replaced so that resid_pre + it == new_mid(resid_mid)."""
    block_path, added_path = (p.replace("{L}", str(layer)) for p in PATHS[case])
    seen = {}

    def keep_resid_pre(module, args, kwargs):
        seen["resid_pre"] = args[0] if args else kwargs["hidden_states"]

    def write(module, args, output):
        added = _first(output)
        new_added = new_mid(seen["resid_pre"] + added) - seen["resid_pre"]
        return new_added if isinstance(output, torch.Tensor) else (new_added, *output[1:])

    handles = [
        model.get_submodule(block_path).register_forward_pre_hook(keep_resid_pre, with_kwargs=True),
        model.get_submodule(added_path).register_forward_hook(write),
    ]
    try:
        return _first(model(**batch))
    finally:
        for handle in handles:
            handle.remove()


def _edited(model: nn.Module, batch: dict, edit) -> torch.Tensor:
    with hs.edit(model, edit):
        return _first(model(**batch))


CASES = [pytest.param(c, marks=() if c in FAST else pytest.mark.slow) for c in PATHS]


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_steer_ablate_patch_at_resid_mid_change_the_stream(case):
    model, batch = _model(case)
    layers = (0, 1) if case in FAST else (LAYER,)
    g = torch.Generator().manual_seed(3)
    plain = _first(model(**batch))
    for layer in layers:
        stream = _stream_shape(model, batch, case, layer)
        v = torch.randn(stream[-1], generator=g)
        point = f"blocks.{layer}.resid_mid"
        steered = _edited(model, batch, hs.steer(point, v, scale=3.0))
        want = _reference(model, batch, case, layer, lambda mid, v=v: mid + 3.0 * v)
        assert not torch.allclose(want, plain, atol=ATOL)  # the steer does change the output
        torch.testing.assert_close(steered, want, atol=ATOL, rtol=0)

        ablated = _edited(model, batch, hs.ablate(point))
        torch.testing.assert_close(
            ablated, _reference(model, batch, case, layer, torch.zeros_like), atol=ATOL, rtol=0
        )

        target = torch.randn(plain.shape[0], *stream, generator=g)
        patched = _edited(model, batch, hs.patch(point, target))
        torch.testing.assert_close(
            patched,
            _reference(model, batch, case, layer, lambda mid, target=target: target),
            atol=ATOL,
            rtol=0,
        )


def _stream_shape(model: nn.Module, batch: dict, case: str, layer: int) -> tuple[int, ...]:
    """[pos, d] of the residual stream at `layer`, read with a plain pre-hook on the block."""
    shape = []
    block = model.get_submodule(PATHS[case][0].replace("{L}", str(layer)))
    handle = block.register_forward_pre_hook(
        lambda m, a, k: shape.extend((a[0] if a else k["hidden_states"]).shape[1:]), with_kwargs=True
    )
    try:
        model(**batch)
    finally:
        handle.remove()
    return tuple(shape)


@pytest.mark.parametrize("case", FAST)
def test_grads_at_resid_mid_with_frozen_weights_reach_both_branches(case):
    """d loss / d resid_mid with no parameter needing grad: the reference is the gradient of a zero
    added to attention's contribution (which both the skip and the MLP read)."""
    model, batch = _model(case)
    model.requires_grad_(False)
    block_path, added_path = (p.replace("{L}", "0") for p in PATHS[case])

    def loss_fn(out):
        return _first(out)[:, -1].pow(2).sum()

    got = hs.grads(model, batch["input_ids"], "blocks.0.resid_mid", loss_fn)["blocks.0.resid_mid"]
    kept = {}

    def add_zero(module, args, output):
        added = _first(output)
        kept["zero"] = torch.zeros_like(added, requires_grad=True)
        return (added + kept["zero"], *output[1:])

    handle = model.get_submodule(added_path).register_forward_hook(add_zero)
    try:
        loss = loss_fn(model(batch["input_ids"]))
    finally:
        handle.remove()
    (want,) = torch.autograd.grad(loss, [kept["zero"]])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("case", FAST)
@torch.no_grad()
def test_generate_steers_resid_mid_on_every_step(case):
    """hs.generate's per-step edit at resid_mid: every step's scores equal the model's own generate
    under a plain hook adding the vector to attention's contribution."""
    model, batch = _model(case)
    ids = batch["input_ids"][:1]
    v = torch.randn(_stream_shape(model, batch, case, 0)[-1], generator=torch.Generator().manual_seed(5))
    opts = {"max_new_tokens": 4, "do_sample": False, "output_scores": True, "return_dict_in_generate": True}
    gen = hs.generate(
        model, ids, edits=[hs.steer("blocks.0.resid_mid", v, scale=3.0)], pad_token_id=0, **opts
    )
    added = model.get_submodule(PATHS[case][1].replace("{L}", "0"))
    handle = added.register_forward_hook(lambda m, a, out: (out[0] + 3.0 * v, *out[1:]))
    try:
        want = model.generate(ids, pad_token_id=0, **opts)
    finally:
        handle.remove()
    assert torch.equal(gen.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(gen.output.scores), torch.stack(want.scores), atol=ATOL, rtol=0)


@torch.no_grad()
def test_bert_resid_mid_is_already_what_both_branches_read():
    """BERT's resid_mid is its attention block's output (after that block's own norm), which the
    layer passes both to the MLP and to the MLP's residual add: a steer there is the plain hook's."""
    model, batch = _model("bert")
    v = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(6))
    attention = model.get_submodule("encoder.layer.1.attention")
    handle = attention.register_forward_hook(lambda m, a, out: (out[0] + 3.0 * v, *out[1:]))
    try:
        want = model(**batch).last_hidden_state
    finally:
        handle.remove()
    got = _edited(model, batch, hs.steer("blocks.1.resid_mid", v, scale=3.0))
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_generate_under_blocks_compile_steers_resid_mid_as_eager():
    """The two hooks of a resid_mid write, traced into compiled blocks: the same tokens and
    captures as eager (checked above against plain hooks), with no frame failing to compile."""
    from hookscope.compiling import compile_model, compile_stats, reset_stats
    from hookscope.testing import build_tiny

    torch._dynamo.reset()
    eager = build_tiny("gpt2", n_layers=2, d_model=32, n_heads=4, seed=5)
    compiled = compile_model(copy.deepcopy(eager), "blocks", backend="eager")
    reset_stats()
    ids = torch.tensor([[1, 7, 42, 99], [5, 17, 300, 8]])
    vector = torch.randn(32, generator=torch.Generator().manual_seed(0)) * 6
    points = ["blocks.0.attn.out", "blocks.1.resid_mid", "blocks.1.resid_post"]
    want, got = (
        hs.generate(
            model,
            ids,
            points,
            edits=[hs.steer("blocks.0.resid_mid", vector)],
            max_new_tokens=4,
            do_sample=False,
        )
        for model in (eager, compiled)
    )
    assert torch.equal(got.sequences, want.sequences)
    for point in points:
        torch.testing.assert_close(got[point], want[point], atol=1e-5, rtol=1e-4)
    stats = compile_stats()
    assert stats["frames_compiled"] > 0 and stats["frames_failed"] == 0, stats
    torch._dynamo.reset()
