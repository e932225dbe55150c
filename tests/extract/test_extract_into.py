"""The CPU extraction writes each point's kept rows once, into memory reused batch after batch
(extract/lending.py's capture, extract/copyout.py `CopyOut.lend`, token_rows.py's gather `out=`,
extract/ring.py),
and the statistics take their float32 copy in a reused `Workspace` (store/stats.py). The rows, the
statistics and the stored bytes must be those of fresh memory: each test holds them to an
independent reference (boolean-mask indexing, plain forward hooks, a float64 recomputation)."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import corpus_fixture

import hookscope as hs
from hookscope.extract import ExtractConfig, extract
from hookscope.extract import loop as loop_module  # the module (hookscope.extract is also hs.extract)
from hookscope.extract import stages as stages_module
from hookscope.extract.ring import HostRing
from hookscope.sources import batches, iter_documents, pack
from hookscope.store import PointStats, open_store
from hookscope.store import writer as writer_module
from hookscope.store.stats import Workspace
from hookscope.token_rows import KeptRows, select_tokens

corpus = corpus_fixture(60)


def long_runs(batch: int, pos: int) -> torch.Tensor:
    """A packed batch's mask: every token kept but a few documents' first ones (runs of ~100)."""
    keep = torch.ones(batch, pos, dtype=torch.bool)
    keep.view(-1)[::97] = False
    return keep


def scattered(batch: int, pos: int) -> torch.Tensor:
    """Half the tokens kept at random (the gather first, then the cast)."""
    return torch.rand(batch, pos, generator=torch.Generator().manual_seed(3)) < 0.5


def none_kept(batch: int, pos: int) -> torch.Tensor:
    return torch.zeros(batch, pos, dtype=torch.bool)


@pytest.mark.parametrize("make_mask", [long_runs, scattered, none_kept])
@pytest.mark.parametrize("cast", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(4, 300, 24), (3, 200, 4, 6)], ids=["rows", "heads"])
def test_rows_gathered_into_a_buffer_equal_boolean_mask_indexing(make_mask, cast, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 1e3
    mask = make_mask(*shape[:2])
    want = x[mask] if cast is None else x[mask].to(cast)
    buffer = torch.full(want.shape, float("nan"), dtype=want.dtype)  # what a reused buffer held before
    got = select_tokens(x, mask, 1, KeptRows(), cast=cast, out=buffer)
    assert got is buffer and got.dtype == want.dtype
    assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))  # bit for bit
    # the same rows as the gather into fresh memory (the path every other capture takes)
    assert torch.equal(
        select_tokens(x, mask, 1, KeptRows(), cast=cast).to(want.dtype).view(torch.uint8),
        want.contiguous().view(torch.uint8),
    )


def test_a_ring_without_a_bound_keeps_as_many_buffers_as_were_out_at_once():
    ring = HostRing(keep=None, pinned=False)
    for _ in range(3):  # three rounds of five at once: five made in all
        out = [ring.take(1000) for _ in range(5)]
        for b in out:
            ring.give_back(b)
    assert ring.made == 5 and len(ring.free) == 5 and ring.out == 0


def float64_stats(rows: torch.Tensor) -> tuple[int, int, float, torch.Tensor, torch.Tensor]:
    """nonfinite, whole rows, the sum of their norms, per-dimension mean and M2, in float64."""
    flat = rows.double().reshape(len(rows), -1)
    whole = torch.isfinite(flat).all(dim=1)
    kept = flat[whole]
    mean = kept.mean(0)
    return (
        int((~torch.isfinite(flat)).sum()),
        int(whole.sum()),
        float(kept.norm(dim=1).sum()),
        mean,
        ((kept - mean) ** 2).sum(0),
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_statistics_in_a_reused_workspace_equal_fresh_ones_and_a_float64_recomputation(dtype):
    g = torch.Generator().manual_seed(1)
    work = Workspace()
    batches_ = [
        torch.randn(300, 8, generator=g) * 5 + 40,
        torch.randn(500, 8, generator=g),
        torch.randn(120, 8, generator=g),
    ]  # grows, then smaller: the same memory reused
    batches_[1][7, 3], batches_[1][400, 0] = float("nan"), float("inf")  # rows left out of the sums
    for rows in (b.to(dtype) for b in batches_):
        before = rows.clone()
        got = PointStats.of(rows, work)
        assert torch.equal(rows.view(torch.uint8), before.view(torch.uint8))  # the input is not written
        assert got == PointStats.of(rows)  # bit for bit the statistics of a fresh copy
        nonfinite, whole, norm_sum, mean, m2 = float64_stats(rows)
        assert (got.nonfinite, got.norm_count) == (nonfinite, whole)
        assert got.norm_sum == pytest.approx(norm_sum, rel=1e-5)
        torch.testing.assert_close(got.mean, mean, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got.m2, m2, rtol=1e-4, atol=1e-3)
    assert 500 * 8 <= work.buffer.numel() < 2 * 500 * 8  # grown once, to the largest batch and a little


@pytest.mark.slow
def test_rows_written_from_reused_buffers_equal_plain_hooks(tiny_dirs, corpus, tmp_path, monkeypatch):
    """Many more batches than the ring's buffers, shards of several batches: a buffer handed back
    before its batch's bytes were written, or written into while the writer reads it, would store
    another batch's rows."""
    made = []

    class Recorded(loop_module.CopyOut):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(loop_module, "CopyOut", Recorded)
    points = ["blocks.1.resid_post", "blocks.0.mlp.post"]
    summary = extract(
        ExtractConfig(
            out=str(tmp_path / "store"),
            model=str(tiny_dirs["gpt2"]),
            points=points,
            data=str(corpus),
            context=32,
            batch_size=2,
            dtype="bfloat16",
            shard_rows=200,
            progress=False,
        )
    )
    loaded = hs.load(str(tiny_dirs["gpt2"]))
    model = loaded.model
    seen, want = {}, {p: [] for p in points}
    hooks = [
        model.transformer.h[1].register_forward_hook(
            lambda m, a, o: seen.__setitem__(points[0], o[0] if isinstance(o, tuple) else o)
        ),
        model.transformer.h[0].mlp.c_proj.register_forward_pre_hook(
            lambda m, a: seen.__setitem__(points[1], a[0])
        ),
    ]
    try:
        with torch.no_grad():
            for batch in batches(pack(iter_documents(str(corpus)), loaded.tokenizer, context=32), 2):
                keep = batch["attention_mask"].bool() & ~batch["special_mask"]
                model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                for p in points:
                    want[p].append(seen[p][keep].to(torch.bfloat16))
    finally:
        for h in hooks:
            h.remove()
    store = open_store(tmp_path / "store", verify=True)
    for p in points:
        assert torch.equal(store.tensor(p).view(torch.int16), torch.cat(want[p]).view(torch.int16))
    ring = made[0].host
    assert ring.made > 0  # the capture wrote its rows into lent buffers (extract/lending.py)
    assert summary.batches_done > 3 * ring.made // len(points)  # buffers were reused, several times over
    assert ring.out == 0  # every one handed back


@pytest.mark.slow
def test_wide_batches_wait_two_at_a_time_for_the_writer(tiny_dirs, corpus, tmp_path, monkeypatch):
    """Batches wider than a quarter of `WRITER_QUEUE_BYTES` wait for the writer two at a time, not
    four, so the ring makes and holds fewer buffers (a slowed writer keeps the queue full); the
    shards are the same bytes."""
    real_save = writer_module.save_columns

    def slow(*args, **kwargs):
        time.sleep(0.05)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(writer_module, "save_columns", slow)
    points = ["blocks.1.resid_post", "blocks.0.mlp.post"]
    made, most = [], {}

    class Recorded(loop_module.CopyOut):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(loop_module, "CopyOut", Recorded)
    for bound in (2**40, 1):  # every batch fits 4 times; none does
        monkeypatch.setattr(stages_module, "WRITER_QUEUE_BYTES", bound)
        extract(
            ExtractConfig(
                out=str(tmp_path / f"s{bound}"),
                model=str(tiny_dirs["gpt2"]),
                points=points,
                data=str(corpus),
                context=32,
                batch_size=2,
                dtype="bfloat16",
                shard_rows=64,
                max_tokens=2048,
                progress=False,
            )
        )
        most[bound] = made[-1].host.most_out
    assert most[1] <= most[2**40] - 2 * len(points)  # two batches fewer waiting, each a buffer a point
    shards = {b: sorted((tmp_path / f"s{b}" / "shards").glob("*.safetensors")) for b in most}
    assert [p.name for p in shards[1]] == [p.name for p in shards[2**40]] and shards[1]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(shards[1], shards[2**40], strict=True))
