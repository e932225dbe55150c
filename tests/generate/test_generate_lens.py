"""hs.generate on a TransformerLens 3.9 HookedTransformer (its own generate and KV cache), against
`run_with_cache` over the final tokens and TL's own `model.hooks(fwd_hooks=...)` steering."""

from __future__ import annotations

import pytest
import torch
from gate import need
from helpers import tiny_hooked_transformer

need("tl3")
from transformer_lens import HookedTransformer  # noqa: E402

import hookscope as hs  # noqa: E402
from hookscope.hooks import hook_count  # noqa: E402

OPTS = dict(max_new_tokens=5, do_sample=False, stop_at_eos=False)


@pytest.fixture(scope="module")
def tl() -> HookedTransformer:
    return tiny_hooked_transformer()


def test_captures_equal_tl_own_hooks_and_run_with_cache(tl):
    """With TL's KV cache, what its blocks compute for new tokens differs from a full forward (TL
    3.9 here: up to ~2.4 on a random model, from the first new token on; its own hooks see the same
    values as ours), so that path is compared with TL's own hooks; without the cache, with
    run_with_cache over the final tokens."""
    toks = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    seen = []
    with tl.hooks(fwd_hooks=[("blocks.0.hook_resid_post", lambda act, hook: seen.append(act.clone()))]):
        expected = tl.generate(toks, verbose=False, **OPTS).clone()
    gen = hs.generate(tl, toks, ["blocks.0.resid_post", "blocks.1.attn.z"], **OPTS)
    assert torch.equal(gen.sequences, expected)
    assert gen.sequences.shape == (2, 11) and gen.mask.all()
    steps = torch.cat(seen, dim=1)  # TL's generate never runs its last token: 10 of 11 positions
    torch.testing.assert_close(gen["blocks.0.resid_post"][:, :10], steps, atol=1e-6, rtol=1e-5)
    _, cache = tl.run_with_cache(gen.sequences)
    torch.testing.assert_close(
        gen["blocks.0.resid_post"][:, :6], cache["blocks.0.hook_resid_post"][:, :6], atol=1e-5, rtol=1e-4
    )

    plain = hs.generate(tl, toks, ["blocks.0.resid_post", "blocks.1.attn.z"], use_past_kv_cache=False, **OPTS)
    _, cache = tl.run_with_cache(plain.sequences)
    for point, name in [
        ("blocks.0.resid_post", "blocks.0.hook_resid_post"),
        ("blocks.1.attn.z", "blocks.1.attn.hook_z"),
    ]:
        torch.testing.assert_close(plain[point], cache[name], atol=1e-5, rtol=1e-4)


def test_steer_equals_tl_hooks(tl):
    toks = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(1))
    vector = torch.randn(32, generator=torch.Generator().manual_seed(2)) * 8
    with tl.hooks(fwd_hooks=[("blocks.0.hook_resid_post", lambda act, hook: act + vector)]):
        expected = tl.generate(toks, verbose=False, **OPTS)
    assert not torch.equal(expected, tl.generate(toks, verbose=False, **OPTS))
    before = hook_count(tl)
    gen = hs.generate(tl, toks, edits=[hs.steer("blocks.0.resid_post", vector)], **OPTS)
    assert torch.equal(gen.sequences, expected)
    assert hook_count(tl) == before
    with pytest.raises(hs.SelectionError, match="outside its forward"):
        hs.generate(tl, toks, "embed", **OPTS)


@pytest.fixture(scope="module")
def tl_tokenized(tmp_path_factory) -> HookedTransformer:
    """A HookedTransformer with a tokenizer (pad id = BOS id = EOS id = 0, as GPT-2's share one):
    TL 3.9's generate reads a batch's padding off it."""
    from transformers import AutoTokenizer

    from hookscope.testing import train_tokenizer

    path = tmp_path_factory.mktemp("tok")
    train_tokenizer().save_pretrained(path)
    model = tiny_hooked_transformer(d_vocab=512)
    model.set_tokenizer(AutoTokenizer.from_pretrained(path))
    assert model.tokenizer.pad_token_id == 0
    return model


def test_left_padded_batch_equals_rows_one_by_one(tl_tokenized):
    tl = tl_tokenized
    ids = torch.tensor([[3, 3, 7, 42, 99, 12], [5, 17, 300, 8, 61, 4]])  # row 0: 2 pads (any id)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    points = ["blocks.0.resid_post", "blocks.1.attn.z"]
    gen = hs.generate(tl, {"input_ids": ids, "attention_mask": mask}, points, **OPTS)
    assert torch.equal(gen.sequences[:, :6], ids)  # the prompt as given
    assert gen.mask[0].tolist() == [False, False] + [True] * 9 and gen.mask[1].all()
    for b in range(2):
        row = ids[b : b + 1, mask[b].bool()]
        expected = tl.generate(row, verbose=False, **OPTS).clone()  # TL alone, unpadded
        assert torch.equal(gen.sequences[b, gen.mask[b]], expected[0])
        _, cache = tl.run_with_cache(expected, attention_mask=torch.ones_like(expected))
        for point, name in [
            ("blocks.0.resid_post", "blocks.0.hook_resid_post"),
            ("blocks.1.attn.z", "blocks.1.attn.hook_z"),
        ]:
            torch.testing.assert_close(gen[point][b][gen.mask[b]], cache[name][0], atol=1e-5, rtol=1e-4)
    # steering a padded batch: each row steered as it is alone
    vector = torch.randn(32, generator=torch.Generator().manual_seed(2)) * 8
    steered = hs.generate(
        tl,
        {"input_ids": ids, "attention_mask": mask},
        edits=[hs.steer("blocks.0.resid_post", vector)],
        **OPTS,
    )
    with tl.hooks(fwd_hooks=[("blocks.0.hook_resid_post", lambda act, hook: act + vector)]):
        alone = tl.generate(ids[:1, 2:], verbose=False, **OPTS)
    assert torch.equal(steered.sequences[0, 2:], alone[0])


def test_padding_it_cannot_follow_is_refused(tl, tl_tokenized):
    ids = torch.tensor([[3, 3, 7, 42], [5, 17, 30, 8]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    before = hook_count(tl)
    with pytest.raises(hs.HookscopeError, match="set_tokenizer"):
        hs.generate(tl, {"input_ids": ids, "attention_mask": mask}, "blocks.0.resid_post", **OPTS)
    assert hook_count(tl) == before
    # the first real token is the pad id: generate would take it for padding
    with pytest.raises(hs.HookscopeError, match="would not see this padding"):
        hs.generate(
            tl_tokenized,
            {"input_ids": torch.tensor([[3, 3, 0, 42], [5, 17, 30, 8]]), "attention_mask": mask},
            "blocks.0.resid_post",
            **OPTS,
        )
