"""hs.generate: captures and edits during Hugging Face generate, against independent references
(a teacher-forced forward with output_hidden_states / plain torch hooks, generate with a
hand-written forward hook, the rows generated one by one).

Tolerance: float32, atol 1e-5 / rtol 1e-4 between the KV-cache path and a teacher-forced pass
over the final sequences (same math, different matmul shapes: rounding only)."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import hookscope as hs
from hookscope.hooks import hook_count
from hookscope.testing import build_tiny

ATOL, RTOL = 1e-5, 1e-4
NEW = 6


@pytest.fixture(scope="module")
def gpt2():
    return build_tiny("gpt2", n_layers=2, d_model=32, n_heads=4, seed=3)


@pytest.fixture(scope="module")
def llama():
    return build_tiny("llama", n_layers=2, d_model=32, n_heads=4, seed=4)


def prompt_batch():
    """Two prompts of different lengths, left-padded (pad id 1, mask 0)."""
    ids = torch.tensor([[1, 1, 7, 42, 99], [5, 17, 300, 8, 61]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    return {"input_ids": ids, "attention_mask": mask}


def teacher_forced(model, sequences, prompt_mask):
    """One plain forward over the final sequences, with the masks and position ids generate used."""
    full = torch.ones_like(sequences)
    full[:, : prompt_mask.shape[1]] = prompt_mask
    position_ids = (full.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(sequences, attention_mask=full, position_ids=position_ids, output_hidden_states=True)


def block_of(model, layer):
    return model.transformer.h[layer] if hasattr(model, "transformer") else model.model.layers[layer]


def add_to_block_output(vector):
    def hook(module, args, output):
        if isinstance(output, torch.Tensor):
            return output + vector
        return (output[0] + vector, *output[1:])

    return hook


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_captures_equal_a_teacher_forced_forward(family, gpt2, llama):
    model = gpt2 if family == "gpt2" else llama
    inputs = prompt_batch()
    gen = hs.generate(
        model,
        inputs,
        ["blocks.0.resid_post", "blocks.1.resid_post", "logits"],
        max_new_tokens=NEW,
        do_sample=False,
        pad_token_id=1,
    )
    seqs = gen.sequences
    assert seqs.shape == (2, 5 + NEW)
    ref = teacher_forced(model, seqs, inputs["attention_mask"])
    real = gen.mask
    assert real[:, :5].tolist() == inputs["attention_mask"].bool().tolist()
    for name, expected in [("blocks.0.resid_post", ref.hidden_states[1]), ("logits", ref.logits)]:
        got = gen[name]
        assert got.shape == expected.shape
        torch.testing.assert_close(got[real], expected[real], atol=ATOL, rtol=RTOL)
    # the last block's output: hidden_states[-1] has the final norm applied, so read it with a hook
    seen = {}
    handle = block_of(model, 1).register_forward_hook(
        lambda m, a, o: seen.update(x=o if isinstance(o, torch.Tensor) else o[0])
    )
    try:
        teacher_forced(model, seqs, inputs["attention_mask"])
    finally:
        handle.remove()
    torch.testing.assert_close(gen["blocks.1.resid_post"][real], seen["x"][real], atol=ATOL, rtol=RTOL)
    # and the tokens are those of plain generate
    plain = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, pad_token_id=1)
    assert torch.equal(plain, seqs)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_no_deprecated_argument_is_passed(family, gpt2, llama):
    """transformers deprecates `past_key_values` for `cache` (FutureWarning, removal in 5.40); plain
    generate warns about nothing, and neither may hs.generate: its cached last step included (a point
    asked for), its tokens and captures still those of plain generate and a teacher-forced pass."""
    model = gpt2 if family == "gpt2" else llama
    inputs = prompt_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        warnings.simplefilter("error", FutureWarning)
        plain = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, pad_token_id=1)
        gen = hs.generate(
            model, inputs, "blocks.1.resid_pre", max_new_tokens=NEW, do_sample=False, pad_token_id=1
        )
    assert torch.equal(gen.sequences, plain)
    ref = teacher_forced(model, plain, inputs["attention_mask"])
    assert gen.mask[:, -1].all()  # the last token's activations come from the extra cached step
    torch.testing.assert_close(
        gen["blocks.1.resid_pre"][gen.mask], ref.hidden_states[1][gen.mask], atol=ATOL, rtol=RTOL
    )


def test_per_head_point_equals_a_plain_hook(gpt2):
    inputs = prompt_batch()
    gen = hs.generate(gpt2, inputs, "blocks.1.attn.z", max_new_tokens=NEW, pad_token_id=1)
    seen = {}
    handle = gpt2.transformer.h[1].attn.c_proj.register_forward_pre_hook(lambda m, a: seen.update(z=a[0]))
    try:
        teacher_forced(gpt2, gen.sequences, inputs["attention_mask"])
    finally:
        handle.remove()
    expected = seen["z"].unflatten(-1, (4, -1))
    assert gen["blocks.1.attn.z"].shape == expected.shape
    torch.testing.assert_close(gen["blocks.1.attn.z"][gen.mask], expected[gen.mask], atol=ATOL, rtol=RTOL)


def test_sampling_with_a_seed_gives_the_tokens_of_plain_generate(gpt2):
    inputs = prompt_batch()
    torch.manual_seed(11)
    plain = gpt2.generate(**inputs, max_new_tokens=NEW, do_sample=True, top_k=50, pad_token_id=1)
    torch.manual_seed(11)
    gen = hs.generate(
        gpt2, inputs, "blocks.0.resid_post", max_new_tokens=NEW, do_sample=True, top_k=50, pad_token_id=1
    )
    assert torch.equal(plain, gen.sequences)
    ref = teacher_forced(gpt2, gen.sequences, inputs["attention_mask"])
    torch.testing.assert_close(
        gen["blocks.0.resid_post"][gen.mask], ref.hidden_states[1][gen.mask], atol=ATOL, rtol=RTOL
    )


def test_num_return_sequences(gpt2):
    inputs = prompt_batch()
    opts = dict(max_new_tokens=4, do_sample=True, num_return_sequences=2, pad_token_id=1)
    torch.manual_seed(5)
    plain = gpt2.generate(**inputs, **opts)
    torch.manual_seed(5)
    gen = hs.generate(gpt2, inputs, "blocks.0.resid_post", **opts)
    assert torch.equal(plain, gen.sequences) and gen.sequences.shape[0] == 4
    ref = teacher_forced(gpt2, gen.sequences, inputs["attention_mask"].repeat_interleave(2, 0))
    assert gen.mask[:, :5].tolist() == inputs["attention_mask"].repeat_interleave(2, 0).bool().tolist()
    torch.testing.assert_close(
        gen["blocks.0.resid_post"][gen.mask], ref.hidden_states[1][gen.mask], atol=ATOL, rtol=RTOL
    )


def test_selections_match_collect_semantics(gpt2):
    inputs = prompt_batch()
    opts = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=1)
    full = hs.generate(gpt2, inputs, ["blocks.1.resid_post", "blocks.1.attn.z"], **opts)
    x, z = full["blocks.1.resid_post"], full["blocks.1.attn.z"]
    total = x.shape[1]
    cases = [
        ("last", x[:, -1]),
        (-3, x[:, total - 3]),
        (2, x[:, 2]),
        ([0, 7, -1], x[:, [0, 7, total - 1]]),
        (slice(5, None), x[:, 5:]),
        (slice(-4, None), x[:, -4:]),
        (slice(1, 9, 3), x[:, 1:9:3]),
        (torch.tensor([4, 9]), x[torch.arange(2), torch.tensor([4, 9])]),  # one per row, as in collect
    ]
    for positions, expected in cases:
        got = hs.generate(gpt2, inputs, "blocks.1.resid_post", positions=positions, **opts)
        assert torch.equal(got.sequences, full.sequences)
        assert got["blocks.1.resid_post"].shape == expected.shape, positions
        torch.testing.assert_close(got["blocks.1.resid_post"], expected, atol=0, rtol=0)
    heads = hs.generate(gpt2, inputs, "blocks.1.attn.z", heads=[2], dtype=torch.bfloat16, **opts)
    assert torch.equal(heads["blocks.1.attn.z"], z[:, :, [2]].to(torch.bfloat16))
    with pytest.raises(hs.SelectionError):
        hs.generate(gpt2, inputs, "blocks.1.resid_post", heads=[0], **opts)  # no head dim, as in collect
    with pytest.raises(hs.SelectionError):
        hs.generate(gpt2, inputs, "blocks.1.resid_post", positions=[total + 3], **opts)


def test_left_padded_batch_equals_rows_one_by_one(gpt2, llama):
    for model in (gpt2, llama):
        inputs = prompt_batch()
        batch = hs.generate(model, inputs, "blocks.1.resid_post", max_new_tokens=NEW, pad_token_id=1)
        for row in range(2):
            real = inputs["attention_mask"][row].bool()
            alone = hs.generate(
                model,
                inputs["input_ids"][row][real][None],
                "blocks.1.resid_post",
                max_new_tokens=NEW,
                pad_token_id=1,
            )
            assert torch.equal(batch.sequences[row][batch.mask[row]], alone.sequences[0])
            torch.testing.assert_close(
                batch["blocks.1.resid_post"][row][batch.mask[row]],
                alone["blocks.1.resid_post"][0],
                atol=ATOL,
                rtol=RTOL,
            )


def test_eos_masks_the_positions_after_it(gpt2):
    inputs = prompt_batch()
    plain = gpt2.generate(**inputs, max_new_tokens=NEW, do_sample=False, pad_token_id=1)
    eos = int(plain[0, 5 + 1])  # row 0's second new token becomes EOS
    gen = hs.generate(
        gpt2, inputs, "blocks.0.resid_post", max_new_tokens=NEW, pad_token_id=1, eos_token_id=eos
    )
    seqs, mask = gen.sequences, gen.mask
    first = (seqs[0, 5:] == eos).nonzero()[0].item() + 5
    assert mask[0, : first + 1].tolist() == [False, False] + [True] * (first - 1)
    assert not mask[0, first + 1 :].any()
    assert (seqs[0, first + 1 :] == 1).all()  # generate padded row 0 after its EOS
    row1_eos = (seqs[1, 5:] == eos).nonzero()
    if len(row1_eos) == 0:
        assert mask[1].all()
    assert gen["blocks.0.resid_post"].shape[:2] == seqs.shape
    ref = teacher_forced(gpt2, seqs, inputs["attention_mask"])
    torch.testing.assert_close(
        gen["blocks.0.resid_post"][mask], ref.hidden_states[1][mask], atol=ATOL, rtol=RTOL
    )


@pytest.mark.parametrize("edit_on", ["both", "prompt", "generated"])
def test_steer_gives_the_tokens_of_a_hand_written_hook(gpt2, edit_on):
    inputs = prompt_batch()
    vector = torch.randn(32, generator=torch.Generator().manual_seed(0)) * 6
    opts = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=1)
    calls = []

    def hand(module, args, output):
        prompt_pass = not calls
        calls.append(1)
        if edit_on == "both" or (edit_on == "prompt") == prompt_pass:
            return add_to_block_output(vector)(module, args, output)
        return None

    handle = gpt2.transformer.h[0].register_forward_hook(hand)
    try:
        expected = gpt2.generate(**inputs, **opts)
    finally:
        handle.remove()
    unsteered = gpt2.generate(**inputs, **opts)
    assert not torch.equal(expected, unsteered)  # the vector is strong enough to matter
    gen = hs.generate(gpt2, inputs, edits=[hs.steer("blocks.0.resid_post", vector)], edit_on=edit_on, **opts)
    assert torch.equal(gen.sequences, expected)


def test_captures_see_the_steered_value(gpt2):
    inputs = prompt_batch()
    vector = torch.randn(32, generator=torch.Generator().manual_seed(1)) * 3
    gen = hs.generate(
        gpt2,
        inputs,
        ["blocks.0.resid_post", "blocks.1.resid_post"],
        edits=[hs.steer("blocks.0.resid_post", vector)],
        max_new_tokens=NEW,
        pad_token_id=1,
    )
    # (a hook of our own reads the steered value: transformers' output_hidden_states records block
    # outputs with hooks of its own, which may run before the steering hook)
    seen = {}
    handles = [
        gpt2.transformer.h[0].register_forward_hook(add_to_block_output(vector)),
        gpt2.transformer.h[0].register_forward_hook(lambda m, a, o: seen.update(x0=o)),
        gpt2.transformer.h[1].register_forward_hook(lambda m, a, o: seen.update(x1=o)),
    ]
    try:
        teacher_forced(gpt2, gen.sequences, inputs["attention_mask"])
    finally:
        for handle in handles:
            handle.remove()
    for point, key in [("blocks.0.resid_post", "x0"), ("blocks.1.resid_post", "x1")]:
        expected = seen[key] if isinstance(seen[key], torch.Tensor) else seen[key][0]
        torch.testing.assert_close(gen[point][gen.mask], expected[gen.mask], atol=ATOL, rtol=RTOL)


def test_steer_at_sequence_positions(gpt2):
    """positions= on an edit are sequence positions: steer only token 6 (the second new one)."""
    inputs = prompt_batch()
    vector = torch.randn(32, generator=torch.Generator().manual_seed(2)) * 6
    opts = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=1)
    state = {"filled": 0}

    def hand(module, args, output):
        x = output if isinstance(output, torch.Tensor) else output[0]
        lo = state["filled"]
        state["filled"] += x.shape[1]
        if lo <= 6 < lo + x.shape[1]:
            x = x.clone()
            x[:, 6 - lo] += vector
            return x if isinstance(output, torch.Tensor) else (x, *output[1:])
        return None

    handle = gpt2.transformer.h[0].register_forward_hook(hand)
    try:
        expected = gpt2.generate(**inputs, **opts)
    finally:
        handle.remove()
    gen = hs.generate(gpt2, inputs, edits=[hs.steer("blocks.0.resid_post", vector, positions=[6])], **opts)
    assert torch.equal(gen.sequences, expected)
    assert not torch.equal(gen.sequences, gpt2.generate(**inputs, **opts))


def test_ablate_heads_and_patch_the_prompt(gpt2):
    inputs = prompt_batch()
    opts = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=1)
    attn_proj = gpt2.transformer.h[1].attn.c_proj

    def zero_head(module, args):
        z = args[0].unflatten(-1, (4, -1)).clone()
        z[:, :, 1] = 0
        return (z.flatten(-2),)

    handle = attn_proj.register_forward_pre_hook(zero_head)
    try:
        expected = gpt2.generate(**inputs, **opts)
    finally:
        handle.remove()
    gen = hs.generate(gpt2, inputs, edits=[hs.ablate("blocks.1.attn.z", heads=[1])], **opts)
    assert torch.equal(gen.sequences, expected)

    # patch the prompt's block-0 output with that of another prompt of the same length
    other = {
        "input_ids": torch.tensor([[1, 1, 300, 2, 9], [44, 3, 8, 8, 150]]),
        "attention_mask": inputs["attention_mask"],
    }
    source = hs.collect(gpt2, other, "blocks.0.resid_post")
    calls = []

    def hand(module, args, output):
        calls.append(1)
        if len(calls) == 1:
            return (
                source["blocks.0.resid_post"]
                if isinstance(output, torch.Tensor)
                else (source["blocks.0.resid_post"], *output[1:])
            )
        return None

    handle = gpt2.transformer.h[0].register_forward_hook(hand)
    try:
        expected = gpt2.generate(**inputs, **opts)
    finally:
        handle.remove()
    gen = hs.generate(
        gpt2,
        inputs,
        "blocks.0.resid_post",
        edits=[hs.patch("blocks.0.resid_post", source)],
        edit_on="prompt",
        **opts,
    )
    assert torch.equal(gen.sequences, expected)
    torch.testing.assert_close(gen["blocks.0.resid_post"][:, :5], source["blocks.0.resid_post"])
    with pytest.raises(hs.SelectionError, match="source covers 5 positions"):
        hs.generate(gpt2, inputs, edits=[hs.patch("blocks.0.resid_post", source)], edit_on="both", **opts)


def test_no_hook_remains_after_generation_raises(gpt2):
    inputs = prompt_batch()
    before = hook_count(gpt2)

    class Boom(RuntimeError):
        pass

    def explode(input_ids, scores):
        if input_ids.shape[1] >= 7:
            raise Boom("stop here")
        return scores

    from transformers import LogitsProcessorList

    with pytest.raises(Boom):
        hs.generate(
            gpt2,
            inputs,
            ["blocks.0.resid_post", "blocks.1.attn.z"],
            edits=[hs.steer("blocks.1.resid_post", torch.ones(32))],
            max_new_tokens=NEW,
            pad_token_id=1,
            logits_processor=LogitsProcessorList([explode]),
        )
    assert hook_count(gpt2) == before
    with pytest.raises(hs.SelectionError):  # an edit that fails inside its hook
        hs.generate(
            gpt2,
            inputs,
            "blocks.0.resid_post",
            edits=[hs.patch("blocks.0.resid_post", torch.zeros(2, 3, 32))],
            max_new_tokens=2,
            pad_token_id=1,
        )
    assert hook_count(gpt2) == before
    # and the model still generates as before
    plain = gpt2.generate(**inputs, max_new_tokens=2, do_sample=False, pad_token_id=1)
    assert torch.equal(plain, hs.generate(gpt2, inputs, max_new_tokens=2, pad_token_id=1).sequences)


def test_refuses_what_it_cannot_align(gpt2):
    inputs = prompt_batch()
    with pytest.raises(hs.HookscopeError, match="num_beams"):
        hs.generate(gpt2, inputs, "blocks.0.resid_post", num_beams=2, max_new_tokens=2)
    right = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"].flip(1)}
    with pytest.raises(hs.HookscopeError, match="left"):
        hs.generate(gpt2, right, "blocks.0.resid_post", max_new_tokens=2)
    with pytest.raises(hs.SelectionError, match="attention weights"):
        hs.generate(gpt2, inputs, "blocks.0.attn.pattern", max_new_tokens=2)
    with pytest.raises(hs.SelectionError, match="edit_on"):
        hs.generate(gpt2, inputs, "blocks.0.resid_post", edit_on="later", max_new_tokens=2)
    with pytest.raises(hs.SelectionError, match="before the sequence ends"):
        hs.generate(
            gpt2,
            inputs,
            edits=[hs.steer("blocks.0.resid_post", torch.ones(32), positions="last")],
            max_new_tokens=2,
        )


def test_without_the_kv_cache(gpt2):
    inputs = prompt_batch()
    cached = hs.generate(gpt2, inputs, "blocks.1.resid_post", max_new_tokens=4, pad_token_id=1)
    uncached = hs.generate(
        gpt2, inputs, "blocks.1.resid_post", max_new_tokens=4, pad_token_id=1, use_cache=False
    )
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(
        uncached["blocks.1.resid_post"][cached.mask],
        cached["blocks.1.resid_post"][cached.mask],
        atol=ATOL,
        rtol=RTOL,
    )


def test_cli_prints_text_and_writes_captures(tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from hookscope.cli import main
    from hookscope.testing import save_tiny

    path = save_tiny("gpt2", tmp_path / "model", n_layers=2, d_model=32, n_heads=4)
    vector = torch.randn(32, generator=torch.Generator().manual_seed(0)) * 5
    save_file({"v": vector}, str(tmp_path / "v.safetensors"))
    out = tmp_path / "caps.safetensors"
    prompts = ["The quick brown fox", "Paris is"]
    rc = main(
        [
            "generate",
            str(path),
            "--prompt",
            prompts[0],
            "--prompt",
            prompts[1],
            "--max-new-tokens",
            "4",
            "--points",
            "blocks.1.resid_post",
            "--out",
            str(out),
            "--steer",
            f"blocks.0.resid_post:{tmp_path / 'v.safetensors'}:2",
            "--edit-on",
            "generated",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out.splitlines()
    # the same call from Python, left-padded as the CLI pads
    model, tok, _ = hs.load(str(path))
    tok.padding_side, tok.pad_token = "left", tok.eos_token
    inputs = tok(prompts, return_tensors="pt", padding=True)
    steer = hs.steer("blocks.0.resid_post", vector, scale=2)
    gen = hs.generate(
        model,
        inputs,
        "blocks.1.resid_post",
        edits=[steer],
        edit_on="generated",
        max_new_tokens=4,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
    )
    assert printed == [p + t for p, t in zip(prompts, gen.text(tok), strict=True)]
    with safe_open(str(out), "pt") as f:
        assert torch.equal(f.get_tensor("sequences"), gen.sequences)
        assert torch.equal(f.get_tensor("mask"), gen.mask)
        torch.testing.assert_close(f.get_tensor("blocks.1.resid_post"), gen["blocks.1.resid_post"])
        assert int(f.metadata()["prompt_length"]) == gen.prompt_length
    missing = "blocks.0.resid_post:missing.safetensors:1"
    assert main(["generate", str(path), "--prompt", "x", "--steer", missing]) == 2
    assert "cannot read steering vector" in capsys.readouterr().err


def test_an_empty_kv_cache_is_refused_not_generated_from(gpt2, monkeypatch):
    """A model whose attention does not store into the cache it is given (TransformerLens 4.3's bridge
    under transformers >= 5.24) computes each new token without its context: refused at the first
    cached step, hooks gone, rather than wrong tokens and activations returned."""
    from transformers import DynamicCache

    ids = prompt_batch()["input_ids"][1:]
    right = hs.generate(gpt2, ids, "blocks.1.resid_post", max_new_tokens=3)
    monkeypatch.setattr(DynamicCache, "update", lambda self, key, value, *args, **kwargs: (key, value))
    # transformers >= 5.24 names the forward's cache argument `cache` (the old name is deprecated)
    cache_name = "cache" if "cache" in inspect.signature(type(gpt2).forward).parameters else "past_key_values"
    with torch.no_grad():  # what the broken cache does: the new token sees only itself
        alone = gpt2(
            right.sequences[:, 5:6],
            **{cache_name: DynamicCache(config=gpt2.config)},
            output_hidden_states=True,
        ).hidden_states[2]
    assert not torch.allclose(alone[:, 0], right["blocks.1.resid_post"][:, 5], atol=1e-3)
    before = hook_count(gpt2)  # (transformers keeps hooks of its own once output_hidden_states was asked)
    with pytest.raises(hs.HookscopeError, match="empty KV cache.*use_cache=False"):
        hs.generate(gpt2, ids, "blocks.1.resid_post", max_new_tokens=3)
    assert hook_count(gpt2) == before
    # the way out it names: every step recomputes the whole sequence, and the captures are right again
    uncached = hs.generate(gpt2, ids, "blocks.1.resid_post", max_new_tokens=3, use_cache=False)
    assert torch.equal(uncached.sequences, right.sequences)
    torch.testing.assert_close(
        uncached["blocks.1.resid_post"], right["blocks.1.resid_post"], atol=ATOL, rtol=RTOL
    )
