"""positions="last" in padded batches (issue 14, item 1): with an attention mask (given, or passed
to the model), "last" is each row's last real token, for right and left padding alike.

References: the same row run alone with no padding, read at its last position by a plain
`register_forward_hook`; and, on the padded batch itself, a plain hook indexed by hand.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs
from hookscope.hooks import hook_count

TEXTS = ["a short one", "a somewhat longer sentence than the first one is", "mid length text here"]


def padded(loaded: hs.Loaded, side: str) -> dict[str, Tensor]:
    tok = copy.copy(loaded.tokenizer)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    tok.padding_side = side
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    lengths = batch["attention_mask"].sum(1)
    assert len(set(lengths.tolist())) == 3  # really padded: three different lengths
    return dict(batch)


def block_output(model: nn.Module, block: nn.Module, inputs: dict[str, Tensor]) -> Tensor:
    """The block's output on `inputs`, by a plain forward hook."""
    kept = []
    handle = block.register_forward_hook(
        lambda m, a, out: kept.append(out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.inference_mode():
            model(**inputs)
    finally:
        handle.remove()
    return kept[0]


def blocks(loaded: hs.Loaded) -> nn.ModuleList:
    model = loaded.model
    return model.transformer.h if hasattr(model, "transformer") else model.encoder.layer


def alone(loaded: hs.Loaded, batch: dict[str, Tensor], row: int) -> dict[str, Tensor]:
    """Row `row` of a padded batch with its padding cut off."""
    keep = batch["attention_mask"][row].bool()
    return {k: v[row][keep][None] for k, v in batch.items()}


@pytest.mark.parametrize("side", ["right", "left"])
def test_last_is_each_rows_last_real_token_gpt2(tiny, side):
    loaded = tiny["gpt2"]
    batch = padded(loaded, side)
    block = blocks(loaded)[1]
    mask = batch["attention_mask"]

    got = hs.collect(loaded.model, batch, "blocks.1.resid_post", positions="last")["blocks.1.resid_post"]
    # the same batch, the last real token picked by hand
    full = block_output(loaded.model, block, batch)
    last = (mask.shape[1] - 1 - mask.flip(1).argmax(1)) if side == "left" else mask.sum(1) - 1
    if side == "left":
        assert torch.equal(last, torch.full((3,), mask.shape[1] - 1))
    assert torch.equal(got, full[torch.arange(3), last])
    if side == "right":  # a causal model: right padding does not touch the real tokens
        for row in range(3):
            want = block_output(loaded.model, block, alone(loaded, batch, row))[0, -1]
            torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-5)
        # what "last" gave before: the pad token of the short rows, far from the real one
        assert not torch.allclose(got[0], full[0, -1], atol=1e-3)
    assert hook_count(loaded.model) == 0


def test_last_in_a_with_block_and_given_mask(tiny):
    loaded = tiny["gpt2"]
    batch = padded(loaded, "right")
    want = hs.collect(loaded.model, batch, "blocks.0.resid_post", positions="last")["blocks.0.resid_post"]
    with hs.capture(loaded.model, "blocks.0.resid_post", positions="last") as cap:
        loaded.model(**batch)  # the mask the model is called with is the one used
    assert torch.equal(cap["blocks.0.resid_post"], want)
    # given explicitly, for a model called with positional inputs only
    got = hs.collect(
        loaded.model,
        batch["input_ids"],
        "blocks.0.resid_post",
        positions="last",
        attention_mask=batch["attention_mask"],
    )["blocks.0.resid_post"]
    full = hs.collect(loaded.model, batch["input_ids"], "blocks.0.resid_post")["blocks.0.resid_post"]
    lengths = batch["attention_mask"].sum(1)
    assert torch.equal(got, full[torch.arange(3), lengths - 1])
    # no mask anywhere: "last" is position -1, as before
    plain = hs.collect(loaded.model, batch["input_ids"], "blocks.0.resid_post", positions="last")
    assert torch.equal(plain["blocks.0.resid_post"], full[:, -1])


def test_last_on_bert_is_sep_of_each_row(tiny):
    loaded = tiny["bert"]
    batch = padded(loaded, "right")
    got = hs.collect(loaded.model, batch, "blocks.2.resid_post", positions="last")["blocks.2.resid_post"]
    lengths = batch["attention_mask"].sum(1)
    sep = loaded.tokenizer.sep_token_id
    assert torch.equal(batch["input_ids"][torch.arange(3), lengths - 1], torch.full((3,), sep))
    block = blocks(loaded)[2]
    for row in range(3):  # bidirectional: the unpadded row alone is the reference
        want = block_output(loaded.model, block, alone(loaded, batch, row))[0, -1]
        torch.testing.assert_close(got[row], want, rtol=1e-4, atol=1e-5)


def test_last_on_a_point_with_position_dim_2(tiny):
    """attn.pattern is [batch, head, query, key]: "last" picks each row's last real query."""
    loaded = tiny["gpt2"]
    batch = padded(loaded, "right")
    got = hs.collect(loaded.model, batch, "blocks.0.attn.pattern", positions="last")["blocks.0.attn.pattern"]
    full = hs.collect(loaded.model, batch, "blocks.0.attn.pattern")["blocks.0.attn.pattern"]
    lengths = batch["attention_mask"].sum(1)
    assert got.shape == (3, full.shape[1], full.shape[3])
    for row in range(3):
        assert torch.equal(got[row], full[row, :, lengths[row] - 1])


def test_steer_at_last_writes_each_rows_last_real_token(tiny):
    loaded, point = tiny["gpt2"], "blocks.1.resid_post"
    batch = padded(loaded, "right")
    vector = torch.randn(loaded.model.config.n_embd)
    lengths = batch["attention_mask"].sum(1)
    steer = hs.steer(point, vector, positions="last")
    with hs.edit(loaded.model, steer), hs.capture(loaded.model, point) as cap:
        loaded.model(**batch)
    clean = hs.collect(loaded.model, batch, point)[point]
    want = clean.clone()
    want[torch.arange(3), lengths - 1] += vector
    assert torch.equal(cap[point], want)


def test_bad_masks_are_refused(tiny):
    loaded = tiny["gpt2"]
    batch = padded(loaded, "right")
    with pytest.raises(hs.SelectionError, match="attention mask"):
        hs.collect(
            loaded.model,
            batch["input_ids"],
            "blocks.0.resid_post",
            positions="last",
            attention_mask=batch["attention_mask"][:, :3],
        )
    empty = batch["attention_mask"].clone()
    empty[1] = 0
    with pytest.raises(hs.SelectionError, match="no real token"):
        hs.collect(
            loaded.model, batch["input_ids"], "blocks.0.resid_post", positions="last", attention_mask=empty
        )
    assert hook_count(loaded.model) == 0
