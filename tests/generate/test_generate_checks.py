"""hs.generate checks everything before the model generates, and the core pieces it runs on:
`Selection.at(offset)` (a pass over sequence positions from `offset` on) and `Edit.step`.

References are plain indexing of a whole tensor with Python ranges written here, and a model
whose `generate` counts its calls."""

from __future__ import annotations

import pytest
import torch

import hookscope as hs
from hookscope.hooks import hook_count
from hookscope.selection import Selection
from hookscope.testing import build_tiny


class SeqDims:
    pos_dim, head_dim = 1, None


class HeadDims:
    pos_dim, head_dim = 1, 2


@pytest.fixture(scope="module")
def gpt2():
    return build_tiny("gpt2", n_layers=2, d_model=32, n_heads=4, seed=3)


def prompt_batch():
    return {
        "input_ids": torch.tensor([[1, 1, 7, 42, 99], [5, 17, 300, 8, 61]]),
        "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]),
    }


BAD = [
    (dict(points="blocks.0.resid_post", positions=[1.5]), hs.SelectionError, "positions"),
    (dict(points="blocks.0.resid_post", positions="first"), hs.SelectionError, "positions"),
    (dict(points="blocks.9.resid_post"), hs.UnknownPointError, "blocks 0-1"),
    (dict(points="blocks.0.attn.pattern"), hs.SelectionError, "attention weights"),
    (dict(points="blocks.0.resid_post", heads=[0]), hs.SelectionError, "head"),
    (
        dict(edits=[hs.steer("blocks.0.resid_post", torch.ones(32), positions="last")]),
        hs.SelectionError,
        "before the sequence ends",
    ),
    (
        dict(edits=[hs.steer("blocks.0.resid_post", torch.ones(32), positions=[2, -1])]),
        hs.SelectionError,
        "before the sequence ends",
    ),
    (
        dict(edits=[hs.ablate("blocks.0.resid_post", positions=slice(1, -1))]),
        hs.SelectionError,
        "before the sequence ends",
    ),
    (dict(edits=[hs.steer("blocks.7.resid_post", torch.ones(32))]), hs.UnknownPointError, "blocks 0-1"),
    (dict(edits=[lambda act, hook: act]), hs.HookscopeError, "edits= takes"),
    (dict(points="blocks.0.resid_post", edit_on="later"), hs.SelectionError, "edit_on"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_a_bad_call_is_refused_before_the_model_generates(gpt2, monkeypatch, case):
    options, error, match = BAD[case]
    calls = []
    real = gpt2.generate
    monkeypatch.setattr(gpt2, "generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    before = hook_count(gpt2)
    with pytest.raises(error, match=match):
        hs.generate(gpt2, prompt_batch(), max_new_tokens=3, pad_token_id=1, **options)
    assert calls == [] and hook_count(gpt2) == before
    # the counting model generates when the call is right, so a refusal above was a real one
    hs.generate(gpt2, prompt_batch(), "blocks.0.resid_post", max_new_tokens=1, pad_token_id=1)
    assert calls == [1]


def in_pass(positions, offset, size):
    """The positions of range(offset, offset + size) a from-start selection names, in order."""
    return [p for p in positions if offset <= p < offset + size]


@pytest.mark.parametrize(
    "positions, names",
    [
        (7, [7]),
        ([6, 8], [6, 8]),
        ([8, 6], [8, 6]),
        (slice(1, 9, 3), list(range(1, 9, 3))),
        (slice(6, None), list(range(6, 20))),
        (slice(0, 6, 2), [0, 2, 4]),
        (torch.tensor([9, 5, 6]), [9, 5, 6]),
    ],
)
def test_take_and_region_at_an_offset_read_sequence_positions(positions, names):
    x = torch.randn(2, 20, 3, generator=torch.Generator().manual_seed(0))
    offset, size = 5, 5
    chunk = x[:, offset : offset + size]
    sel = Selection.of(positions=positions).at(offset)
    wanted = in_pass(names, offset, size)
    got = sel.take(chunk, SeqDims())
    expected = x[:, 7] if isinstance(positions, int) else x[:, wanted]
    if isinstance(positions, slice):
        expected = x[:, sorted(wanted)]
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    region = sel.region(chunk, SeqDims())
    hand = torch.zeros(size, dtype=torch.bool)
    hand[[p - offset for p in wanted]] = True
    assert torch.equal(region.expand(2, size, 3), hand.view(1, size, 1).expand(2, size, 3))
    assert sel.window(size).tolist() == hand.tolist()


def test_take_at_an_offset_refuses_what_the_pass_does_not_hold():
    chunk = torch.zeros(2, 3, 4)
    with pytest.raises(hs.SelectionError, match=r"\[5, 8\)"):
        Selection.of(positions=[4, 6]).at(5).take(chunk, SeqDims())
    with pytest.raises(hs.SelectionError, match="before the sequence ends"):
        Selection.of(positions=-1).at(5).take(chunk, SeqDims())


@pytest.mark.parametrize(
    "positions, tail, first_pass",
    [
        (None, 0, [True] * 4),
        ("last", 1, [False] * 4),
        (-3, 3, [False] * 4),
        ([1, -2], 2, [False, True, False, False]),
        (slice(-4, None), 4, [False] * 4),
        (slice(-4, 2), 4, [True, True, False, False]),
        (slice(1, -1, 2), 0, [False, True, False, True]),
    ],
)
def test_tail_and_window_cover_every_position_a_final_selection_can_name(positions, tail, first_pass):
    sel = Selection.of(positions=positions)
    assert sel.tail == tail
    assert sel.at(0).window(4).tolist() == first_pass
    # whatever the final length, what the selection names is in the windows or in the tail
    for total in range(5, 12):
        named = set(sel.select(torch.arange(total)[None], SeqDims()).flatten().tolist())
        covered = {p for p in range(total) if sel.at(p).window(1).item()} | set(range(total - tail, total))
        assert named <= covered, (positions, total)


def test_edit_step_writes_its_positions_and_heads_only():
    """An ablation of head 1 at sequence positions [6, 8], on a pass over positions [5, 9)."""
    act = torch.randn(2, 4, 3, 5, generator=torch.Generator().manual_seed(1))
    edit = hs.ablate("blocks.0.attn.z", positions=[6, 8], heads=[1])

    class FakeHook:
        spec = HeadDims()

    step = edit.step(5, 4)
    got = step(act, FakeHook())
    expected = act.clone()
    expected[:, [1, 3], 1] = 0  # sequence positions 6 and 8 of the pass, head 1
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert edit.step(9, 1) is None  # nothing of the edit in that pass
    allowed = torch.tensor([True, True, False, False])  # e.g. edit_on="prompt" with a prompt of 7
    torch.testing.assert_close(edit.step(5, 4, allowed)(act, FakeHook())[:, 3], act[:, 3], atol=0, rtol=0)


def test_patch_step_reads_its_source_at_the_pass_positions():
    source = torch.arange(2 * 8 * 3, dtype=torch.float32).view(2, 8, 3)
    act = torch.zeros(2, 2, 3)

    class FakeHook:
        spec = SeqDims()

    got = hs.patch("blocks.0.resid_post", source).step(6, 2)(act, FakeHook())
    torch.testing.assert_close(got, source[:, 6:8], atol=0, rtol=0)
    with pytest.raises(hs.SelectionError, match="source covers 8 positions but position 8"):
        hs.patch("blocks.0.resid_post", source).step(7, 2)
