"""Edits by point name change the logits exactly as a hand-written torch hook does, compose with
captures in one `with` statement, and are gone after the block."""

from __future__ import annotations

import pytest
import torch
from gate import need
from helpers import tiny_hooked_transformer
from torch import Tensor, nn

import hookscope as hs
from hookscope.hooks import hook_count

HEAD = 1


def out_proj(model: nn.Module, layer: int) -> nn.Module:
    """The attention output projection, whose input is attn.z with heads merged."""
    if model.config.model_type == "gpt2":
        return model.transformer.h[layer].attn.c_proj
    return model.model.layers[layer].self_attn.o_proj


def logits(model: nn.Module, ids: Tensor, *pre_hooks: tuple[nn.Module, object], forward_hooks=()) -> Tensor:
    """Logits of a forward pass with plain torch hooks attached for its duration."""
    handles = [m.register_forward_pre_hook(fn) for m, fn in pre_hooks]
    handles += [m.register_forward_hook(fn) for m, fn in forward_hooks]
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        for h in handles:
            h.remove()


def heads_of(x: Tensor, n_heads: int) -> Tensor:
    b, p, d = x.shape
    return x.view(b, p, n_heads, d // n_heads)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_zero_ablate_one_head(tiny, make_ids, family):
    model = tiny[family].model
    ids, H = make_ids(model), model.config.num_attention_heads

    def zero_head(module, args):
        x = args[0].clone()
        heads_of(x, H)[:, :, HEAD] = 0
        return (x, *args[1:])

    want = logits(model, ids, (out_proj(model, 1), zero_head))
    clean = logits(model, ids)
    with torch.no_grad(), hs.edit(model, hs.ablate("blocks.1.attn.z", heads=[HEAD])):
        got = model(ids).logits
    assert torch.equal(got, want)
    assert not torch.equal(got, clean)
    assert torch.equal(logits(model, ids), clean)  # removed after the block
    assert hook_count(model) == 0


def test_mean_ablation(gpt2, ids):
    H = gpt2.config.n_head

    def mean_mlp(module, args):
        x = args[0]
        return (x.mean(dim=(0, 1), keepdim=True).expand_as(x),)

    def mean_head(module, args):
        z = heads_of(args[0], H)
        new = z.clone()
        new[:, :, 2] = z.mean(dim=(0, 1))[2]
        return (new.view_as(args[0]),)

    blk = gpt2.transformer.h[0]
    with (
        torch.no_grad(),
        hs.edit(gpt2, hs.ablate("blocks.0.mlp.post", "mean"), hs.ablate("blocks.0.attn.z", "mean", heads=2)),
    ):
        got = gpt2(ids).logits
    assert torch.equal(got, logits(gpt2, ids, (blk.mlp.c_proj, mean_mlp), (blk.attn.c_proj, mean_head)))

    # a precomputed mean (from a reference set), at chosen positions only
    mean = torch.randn(64)

    def set_positions(module, args, output):
        new = output.clone()
        new[:, [0, -1]] = mean
        return new

    with (
        torch.no_grad(),
        hs.edit(gpt2, hs.ablate("blocks.1.resid_post", "mean", mean=mean, positions=[0, -1])),
    ):
        got = gpt2(ids).logits
    assert torch.equal(got, logits(gpt2, ids, forward_hooks=[(gpt2.transformer.h[1], set_positions)]))


def test_patch_a_head_from_a_clean_run(gpt2, make_ids):
    clean_ids, corrupt_ids = make_ids(gpt2, seed=1), make_ids(gpt2, seed=2)
    H, proj = gpt2.config.n_head, out_proj(gpt2, 1)
    kept = []
    logits(gpt2, clean_ids, (proj, lambda m, args: kept.append(args[0].clone())))

    def patch_head(module, args):
        x = args[0].clone()
        heads_of(x, H)[:, :, 3] = heads_of(kept[0], H)[:, :, 3]
        return (x,)

    clean = hs.collect(gpt2, clean_ids, "blocks.1.attn.z")
    with torch.no_grad(), hs.edit(gpt2, hs.patch("blocks.1.attn.z", clean, heads=[3])):
        got = gpt2(corrupt_ids).logits
    assert torch.equal(got, logits(gpt2, corrupt_ids, (proj, patch_head)))
    assert not torch.equal(got, logits(gpt2, corrupt_ids))

    # the whole residual stream at some positions, source given as a tensor under a hook_ alias
    clean_resid = hs.collect(gpt2, clean_ids, "blocks.0.resid_post")["blocks.0.resid_post"]

    def patch_positions(module, args, output):
        new = output.clone()
        new[:, [2, 4]] = clean_resid[:, [2, 4]]
        return new

    with torch.no_grad(), hs.edit(gpt2, hs.patch("blocks.0.hook_resid_post", clean_resid, positions=[2, 4])):
        got = gpt2(corrupt_ids).logits
    assert torch.equal(
        got, logits(gpt2, corrupt_ids, forward_hooks=[(gpt2.transformer.h[0], patch_positions)])
    )
    assert hook_count(gpt2) == 0


def test_patch_source_must_match(gpt2, ids):
    with pytest.raises(hs.SelectionError, match="no such point"):
        hs.patch("blocks.1.attn.z", {"blocks.0.attn.z": torch.zeros(1)})
    short = hs.collect(gpt2, ids[:, :3], "blocks.1.attn.z")
    with (
        pytest.raises(hs.SelectionError, match="same input length"),
        hs.edit(gpt2, hs.patch("blocks.1.attn.z", short)),
    ):
        gpt2(ids)
    assert hook_count(gpt2) == 0


@pytest.mark.parametrize("positions", [None, [1, 3], "last"])
def test_steer(gpt2, ids, positions):
    vector = torch.randn(64, generator=torch.Generator().manual_seed(5))
    where = slice(None) if positions is None else ([-1] if positions == "last" else positions)

    def add(module, args, output):
        new = output.clone()
        new[:, where] = output[:, where] + 2.5 * vector
        return new

    with (
        torch.no_grad(),
        hs.edit(gpt2, hs.steer("blocks.1.resid_post", vector, scale=2.5, positions=positions)),
    ):
        got = gpt2(ids).logits
    assert torch.equal(got, logits(gpt2, ids, forward_hooks=[(gpt2.transformer.h[1], add)]))


def test_edit_and_capture_in_one_with(gpt2, ids):
    vector = torch.randn(64, generator=torch.Generator().manual_seed(6))
    before = hs.collect(gpt2, ids, "blocks.0.resid_post")["blocks.0.resid_post"]
    clean = logits(gpt2, ids)
    with (
        hs.edit(gpt2, hs.steer("blocks.0.resid_post", vector), hs.ablate("blocks.2.attn.z", heads=[0])),
        hs.capture(gpt2, ["blocks.0.resid_post", "blocks.1.resid_pre", "blocks.2.attn.z", "logits"]) as cap,
    ):
        out = gpt2(ids).logits
    # the capture, attached after the edits, sees the edited values (here and downstream)
    assert torch.equal(cap["blocks.0.resid_post"], before + vector)
    assert torch.equal(cap["blocks.1.resid_pre"], before + vector)
    assert torch.equal(cap["blocks.2.attn.z"][:, :, 0], torch.zeros(2, 7, 16))
    assert torch.equal(cap["logits"], out)
    assert not torch.equal(out, clean)
    assert hook_count(gpt2) == 0
    assert torch.equal(logits(gpt2, ids), clean)


def test_edit_errors(gpt2, ids):
    with pytest.raises(hs.SelectionError, match="zero"):
        hs.ablate("blocks.0.attn.z", "median")
    with pytest.raises(hs.UnknownPointError, match="blocks.0.attn.z"):
        hs.edit(gpt2, hs.ablate("blocks.0.attn.zz"))
    with pytest.raises(hs.HookscopeError, match="attn.pattern"):
        hs.edit(gpt2, hs.ablate("blocks.0.attn.pattern"))
    with (
        pytest.raises(hs.SelectionError, match="head"),
        hs.edit(gpt2, hs.ablate("blocks.0.resid_post", heads=[1])),
    ):
        gpt2(ids)
    assert hook_count(gpt2) == 0


def test_mean_ablation_averages_over_the_position_dim_wherever_it_is():
    """attn.pattern is [batch, head, query, key]: its position dim is 2, so a mean ablation
    averages over batch and queries, per head and key (issue 13, item 5). The reference is the
    same edit written as a TransformerLens hook."""
    need("tl3")
    model = tiny_hooked_transformer(d_vocab=50, n_ctx=16)
    toks = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(0))

    def mean_over_queries(pattern: Tensor, hook) -> Tensor:
        return pattern.mean(dim=(0, 2), keepdim=True).expand_as(pattern)

    with torch.no_grad():
        want = model.run_with_hooks(toks, fwd_hooks=[("blocks.0.attn.hook_pattern", mean_over_queries)])
        with hs.edit(model, hs.ablate("blocks.0.attn.pattern", "mean")):
            got = model(toks)
        clean = model(toks)
    assert torch.equal(got, want)
    assert not torch.allclose(got, clean)

    def mean_over_heads(pattern: Tensor, hook) -> Tensor:  # what averaging dims (0, 1) did
        return pattern.mean(dim=(0, 1), keepdim=True).expand_as(pattern)

    with torch.no_grad():
        wrong = model.run_with_hooks(toks, fwd_hooks=[("blocks.0.attn.hook_pattern", mean_over_heads)])
    assert not torch.allclose(got, wrong)
    assert hook_count(model) == 0
