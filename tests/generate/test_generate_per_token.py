"""What hs.generate adds per generated token, pinned on CPU where a GPU's costs show as counts: no
read of a tensor's value on the host (on a GPU each waits for the device), and no cast, tensor from
Python data, allocation or concatenation beyond what plain generate does; and the capture buffer's
edge cases (a length not known ahead, rows that stop early) against a teacher-forced forward.

Counts are taken over a run of SHORT and one of LONG new tokens and divided by the difference, so
what a run does once (setting up, the final pass on the last token, shaping the result) cancels."""

from __future__ import annotations

import importlib
import os
import sys
from collections import Counter

import pytest
import torch

import hookscope as hs
from hookscope.testing import build_tiny

SHORT, LONG = 3, 11
POINT = "blocks.1.resid_post"
ATOL, RTOL = 1e-5, 1e-4
# aten ops that read a tensor's value on the host (`.item()`, `bool(t)`, `int(t)`, nonzero)
HOST_READS = ("aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero", "aten::item")
# ops none of which a step of ours needs: a cast or device move, a tensor from Python data, a
# concatenation, a fresh allocation (the capture copies into its buffer), a gather
NOT_PER_TOKEN = HOST_READS + (
    "aten::_to_copy",
    "aten::lift_fresh",
    "aten::cat",
    "aten::clone",
    "aten::empty",
    "aten::empty_strided",
    "aten::index_select",
)
# Tensor methods that read values on the host (or move them there), counted when hookscope calls them
READ_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
OURS = os.path.dirname(hs.__file__)


@pytest.fixture(scope="module")
def gpt2():
    return build_tiny("gpt2", n_layers=3, d_model=32, n_heads=4, seed=5)


def prompt():
    return {
        "input_ids": torch.tensor([[1, 1, 7, 42, 99], [5, 17, 300, 8, 61]]),
        "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]),
    }


def options(new):
    return dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=1)


def counted(run, monkeypatch) -> tuple[Counter, Counter]:
    """(aten ops, hookscope's calls of READ_METHODS) in one call of `run`."""
    calls: Counter = Counter()

    def counting(name, method):
        def wrapper(self, *args, **kwargs):
            if sys._getframe(1).f_code.co_filename.startswith(OURS):
                calls[name] += 1
            return method(self, *args, **kwargs)

        return wrapper

    with monkeypatch.context() as patch:
        for name in READ_METHODS:
            patch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run()
    return Counter(e.name for e in prof.events() if e.name.startswith("aten::")), calls


def per_token(run_for, monkeypatch) -> tuple[dict, dict]:
    run_for(SHORT)()  # warm: first-call work is not per token
    (ops_short, calls_short), (ops_long, calls_long) = (
        counted(run_for(n), monkeypatch) for n in (SHORT, LONG)
    )

    def per(long, short):
        return {
            k: (long[k] - short[k]) / (LONG - SHORT) for k in set(long) | set(short) if long[k] != short[k]
        }

    return per(ops_long, ops_short), per(calls_long, calls_short)


@pytest.fixture(scope="module")
def plain_ops(gpt2) -> dict:
    """Plain generate's aten ops per token: the reference every case compares with, counted once."""
    with torch.inference_mode(), pytest.MonkeyPatch.context() as monkeypatch:
        ops, _ = per_token(lambda n: lambda: gpt2.generate(**prompt(), **options(n)), monkeypatch)
    return ops


def against_plain(plain_ops, run_for, ops, monkeypatch) -> dict:
    """`run_for`'s ops per token, once none of `ops` and no host read of ours is found to be added
    per token over plain generate's `plain_ops`."""
    with torch.inference_mode():
        ours_ops, our_reads = per_token(run_for, monkeypatch)
    added = {op: ours_ops.get(op, 0) - plain_ops.get(op, 0) for op in ops}
    assert {op: n for op, n in added.items() if n} == {}
    assert our_reads == {}
    return ours_ops


def runs(gpt2, case):
    vector64 = torch.randn(32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    steer = hs.steer(POINT, vector64)  # float64 on a float32 model: cast once, not per step
    return {
        "capture": lambda n: lambda: hs.generate(gpt2, prompt(), POINT, **options(n)),
        "steer": lambda n: lambda: hs.generate(gpt2, prompt(), edits=[steer], **options(n)),
        "steer_generated": lambda n: (
            lambda: hs.generate(gpt2, prompt(), edits=[steer], edit_on="generated", **options(n))
        ),
        "capture_and_steer": lambda n: (
            lambda: hs.generate(gpt2, prompt(), ["blocks.0.resid_post", POINT], edits=[steer], **options(n))
        ),
    }[case]


@pytest.mark.parametrize("case", ["capture", "steer", "steer_generated", "capture_and_steer"])
@pytest.mark.slow
def test_a_generated_token_costs_no_host_read_and_no_extra_allocation(gpt2, plain_ops, case, monkeypatch):
    ours_ops = against_plain(plain_ops, runs(gpt2, case), NOT_PER_TOKEN, monkeypatch)
    # what is left per token: a steer's add, a capture's copy into its buffer (and its view ops)
    extra = sum(ours_ops.values()) - sum(plain_ops.values())
    assert extra <= {"capture": 4, "steer": 1, "steer_generated": 1, "capture_and_steer": 9}[case]


@pytest.mark.slow
def test_a_buffer_grown_step_by_step_keeps_what_a_teacher_forced_pass_computes(gpt2, plain_ops, monkeypatch):
    """Without a length known ahead the buffer starts at the prompt's length and doubles."""
    driver = importlib.import_module("hookscope.generate.driver")  # (hs.generate is the function)
    monkeypatch.setattr(driver._Run, "_expected_length", lambda self: 0)
    with torch.inference_mode():
        ours_ops, _ = per_token(runs(gpt2, "capture"), monkeypatch)
    allocations = sum(ours_ops.get(op, 0) - plain_ops.get(op, 0) for op in ("aten::empty", "aten::new_empty"))
    assert allocations <= 0.3  # 5 -> 10 -> 20 positions: one more buffer (2 ops) over the 8 tokens LONG adds
    inputs = prompt()
    gen = hs.generate(gpt2, inputs, [POINT, "blocks.0.resid_post"], **options(LONG))
    assert gen[POINT].shape == (2, 5 + LONG, 32) and gen[POINT].is_contiguous()
    full = torch.ones_like(gen.sequences)
    full[:, :5] = inputs["attention_mask"]
    with torch.no_grad():
        ref = gpt2(
            gen.sequences,
            attention_mask=full,
            position_ids=(full.cumsum(-1) - 1).clamp(min=0),
            output_hidden_states=True,
        ).hidden_states
    mask = gen.mask
    torch.testing.assert_close(gen[POINT][mask], ref[2][mask], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(gen["blocks.0.resid_post"][mask], ref[1][mask], atol=ATOL, rtol=RTOL)


def test_rows_that_stop_early_give_a_sequence_shorter_than_the_buffer(gpt2):
    """Every row hits EOS before max_new_tokens: the sequence ends early, the capture with it."""
    inputs = prompt()
    plain = gpt2.generate(**inputs, max_new_tokens=LONG, do_sample=False, pad_token_id=1)
    eos = int(plain[0, 5])  # row 0's first new token; row 1 is forced to stop too:
    gen = hs.generate(
        gpt2, inputs, POINT, max_new_tokens=LONG, pad_token_id=1, eos_token_id=[eos, int(plain[1, 6])]
    )
    total = gen.sequences.shape[1]
    assert total < 5 + LONG
    assert gen[POINT].shape == (2, total, 32) and gen[POINT].is_contiguous()
    seen = {}
    handle = gpt2.transformer.h[1].register_forward_hook(lambda m, a, o: seen.update(x=o))
    try:
        full = torch.ones_like(gen.sequences)
        full[:, :5] = inputs["attention_mask"]
        with torch.no_grad():
            gpt2(gen.sequences, attention_mask=full, position_ids=(full.cumsum(-1) - 1).clamp(min=0))
    finally:
        handle.remove()
    expected = seen["x"] if isinstance(seen["x"], torch.Tensor) else seen["x"][0]
    torch.testing.assert_close(gen[POINT][gen.mask], expected[gen.mask], atol=ATOL, rtol=RTOL)


def test_a_steer_with_a_vector_of_another_dtype_gives_a_hand_written_hook_values(gpt2):
    """The vector is cast once, before the steps: the steered values are those of a hook that adds
    it cast at every step."""
    vector64 = torch.randn(32, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 4
    inputs = prompt()
    seen = []

    def hand(module, args, output):
        out = (output if isinstance(output, torch.Tensor) else output[0]) + vector64.to(torch.float32)
        seen.append(out.clone())
        return out if isinstance(output, torch.Tensor) else (out, *output[1:])

    handle = gpt2.transformer.h[1].register_forward_hook(hand)
    try:
        expected = gpt2.generate(**inputs, **options(LONG))
    finally:
        handle.remove()
    gen = hs.generate(gpt2, inputs, POINT, edits=[hs.steer(POINT, vector64)], **options(LONG))
    assert torch.equal(gen.sequences, expected)
    steered = torch.cat(seen, dim=1)  # every pass generate ran (all but the last token's)
    torch.testing.assert_close(gen[POINT][:, : steered.shape[1]], steered, atol=0, rtol=0)


def test_the_pass_on_the_last_token_stops_after_the_last_captured_point(gpt2):
    """generate never runs its last sampled token; the pass hs.generate adds for it runs only up to
    the deepest captured point (unless the caller takes generate's cache, which it then extends in
    every layer). Counted with plain forward hooks on the blocks."""
    runs = Counter()
    handles = [
        block.register_forward_hook(lambda m, a, o, i=i: runs.update([i]))
        for i, block in enumerate(gpt2.transformer.h)
    ]
    try:
        gen = hs.generate(gpt2, prompt(), "blocks.1.resid_post", **options(LONG))
        stopped, runs = runs, Counter()
        hs.generate(gpt2, prompt(), "blocks.1.resid_post", return_dict_in_generate=True, **options(LONG))
        whole = runs
    finally:
        for handle in handles:
            handle.remove()
    assert dict(stopped) == {0: LONG + 1, 1: LONG + 1, 2: LONG}  # generate's LONG passes, + 1 up to block 1
    assert dict(whole) == {0: LONG + 1, 1: LONG + 1, 2: LONG + 1}
    assert gen["blocks.1.resid_post"].shape[1] == 5 + LONG


# ops a heads= selection made once per call does not repeat per token: the heads' index from Python
# data (lift_fresh, _to_copy), an edit's head mask (zeros + index_put, ones, the & of the two)
HEADS_MADE_ONCE = HOST_READS + (
    "aten::lift_fresh",
    "aten::_to_copy",
    "aten::index_put_",
    "aten::zeros",
    "aten::ones",
    "aten::bitwise_and",
)


def heads_runs(gpt2, case):
    ablate = hs.ablate("blocks.0.attn.z", heads=[-1])
    return {
        "capture_heads": lambda n: (
            lambda: hs.generate(gpt2, prompt(), "blocks.1.attn.z", heads=[3, 1], **options(n))
        ),
        "ablate_heads": lambda n: lambda: hs.generate(gpt2, prompt(), edits=[ablate], **options(n)),
        "ablate_heads_generated": lambda n: (
            lambda: hs.generate(gpt2, prompt(), edits=[ablate], edit_on="generated", **options(n))
        ),
    }[case]


@pytest.mark.parametrize("case", ["capture_heads", "ablate_heads", "ablate_heads_generated"])
@pytest.mark.slow
def test_a_heads_selection_is_made_once_per_call_not_per_token(gpt2, plain_ops, case, monkeypatch):
    against_plain(plain_ops, heads_runs(gpt2, case), HEADS_MADE_ONCE, monkeypatch)


def test_heads_captured_and_ablated_while_generating_match_plain_hooks_on_the_attention(gpt2):
    """heads=[3, 1] kept of block 1's z, head -1 (3) of block 0's z zeroed on the generated tokens
    only: against pre-hooks on each block's `attn.c_proj` (its input is z, [batch, pos, heads *
    d_head]) that do the same by hand on every pass generate runs."""
    inputs, seen = prompt(), []

    def zero_last_head_of_new_tokens(module, args):
        if args[0].shape[1] != 1:  # the prompt's pass (the KV cache holds it afterwards)
            return None
        z = args[0].unflatten(-1, (4, 8)).clone()
        z[:, :, 3] = 0
        return (z.flatten(-2),)

    handles = [
        gpt2.transformer.h[0].attn.c_proj.register_forward_pre_hook(zero_last_head_of_new_tokens),
        gpt2.transformer.h[1].attn.c_proj.register_forward_pre_hook(
            lambda m, args: seen.append(args[0].unflatten(-1, (4, 8))[:, :, [3, 1]].clone())
        ),
    ]
    try:
        expected = gpt2.generate(**inputs, **options(LONG))
    finally:
        for handle in handles:
            handle.remove()
    gen = hs.generate(
        gpt2,
        inputs,
        "blocks.1.attn.z",
        heads=[3, 1],
        edit_on="generated",
        edits=[hs.ablate("blocks.0.attn.z", heads=[-1])],
        **options(LONG),
    )
    assert torch.equal(gen.sequences, expected)
    by_hand = torch.cat(seen, dim=1)  # every pass generate ran (all but the last token's)
    assert gen["blocks.1.attn.z"].shape == (2, 5 + LONG, 2, 8)
    torch.testing.assert_close(gen["blocks.1.attn.z"][:, : by_hand.shape[1]], by_hand, atol=0, rtol=0)


def test_heads_made_under_inference_mode_serve_a_pass_that_records_gradients(gpt2):
    """One edit (one selection, its head mask made once) first under inference_mode, then in a pass
    whose loss is differentiated: the mask is not an inference tensor autograd refuses to save."""
    ids = prompt()["input_ids"]
    ablate = hs.ablate("blocks.0.attn.z", heads=[1])
    with torch.inference_mode(), hs.edit(gpt2, ablate):
        gpt2(ids)
    with hs.edit(gpt2, ablate):
        loss = gpt2(ids).logits.sum()
    loss.backward()
    weight = gpt2.transformer.h[0].attn.c_attn.weight
    assert weight.grad is not None and bool(weight.grad.abs().sum() > 0)
    gpt2.zero_grad(set_to_none=True)
