"""The CPU statistics in chunks (store/stats.py `PointStats.of` with a `Workspace`): each chunk of
rows cast and reduced while it is in the cache, the chunks' sums added in float64. Held to an
independent reference: the row norms to the plain formula bit for bit (a float32 copy of the whole
batch, `norm(dim=1)`, float64 sums: the manifest's scalars do not move), the per-dimension mean
and M2 to a float64 recomputation, on batches cut into many chunks, the last one short, and with a
NaN / Inf in a later chunk (then the batch is taken value by value)."""

from __future__ import annotations

import threading

import pytest
import torch

from hookscope import token_rows
from hookscope.one_thread import one_thread
from hookscope.store import stats as stats_module
from hookscope.store.stats import PointStats, Workspace
from hookscope.token_rows import KeptRows, select_tokens


def massive(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Dimensions whose means lie up to 600 spreads from 0 (a residual stream's massive ones)."""
    g = torch.Generator().manual_seed(seed)
    offset = torch.linspace(-300, 300, width, dtype=torch.float64)
    spread = torch.linspace(0.5, 4, width, dtype=torch.float64)
    return (offset + torch.randn(rows, width, generator=g, dtype=torch.float64) * spread).to(dtype)


def plain_norms(rows: torch.Tensor) -> tuple[float, float]:
    norms = rows.reshape(len(rows), -1).float().norm(dim=1).double()
    return float(norms.sum()), float((norms**2).sum())


def float64_moments(rows: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    x = rows.reshape(len(rows), -1).double()
    x = x[torch.isfinite(x).all(dim=1)]
    mean = x.sum(0) / len(x)
    return len(x), mean, ((x - mean) ** 2).sum(0)


def bits(v: float) -> int:
    return int(torch.tensor(v, dtype=torch.float64).view(torch.int64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("chunk_rows", [7, 64, 1000])
def test_chunked_statistics_equal_the_plain_norms_and_a_float64_recomputation(monkeypatch, dtype, chunk_rows):
    rows = massive(1000, 48, dtype, seed=chunk_rows)
    monkeypatch.setattr(stats_module, "_CHUNK_BYTES", chunk_rows * 4 * 48)  # 1000 rows: 143 / 16 / 1 chunks
    work = Workspace()
    got = PointStats.of(rows, work)
    assert work.buffer.numel() < (chunk_rows + 1) * 48 * 2  # one chunk's memory, not the batch's
    assert (got.nonfinite, got.norm_count) == (0, 1000)
    assert (bits(got.norm_sum), bits(got.norm_sumsq)) == tuple(map(bits, plain_norms(rows)))
    n, mean, m2 = float64_moments(rows)
    std = (m2 / n).sqrt()
    assert float(((got.mean - mean).abs() / std).max()) < 1e-6  # a millionth of the spread, 600 spreads out
    torch.testing.assert_close(got.m2, m2, rtol=1e-5, atol=0)


@pytest.mark.parametrize("bad_row", [3, 700, 999])
def test_a_nonfinite_value_in_any_chunk_leaves_its_row_out(monkeypatch, bad_row):
    rows = massive(1000, 16, torch.bfloat16, seed=bad_row)
    rows[bad_row, 5] = float("nan")
    rows[(bad_row + 1) % 1000, 0] = float("-inf")
    monkeypatch.setattr(stats_module, "_CHUNK_BYTES", 64 * 4 * 16)
    got = PointStats.of(rows, Workspace())
    assert (got.nonfinite, got.norm_count) == (2, 998)
    n, mean, m2 = float64_moments(rows)
    whole = torch.isfinite(rows.float()).all(dim=1)
    assert (bits(got.norm_sum), bits(got.norm_sumsq)) == tuple(map(bits, plain_norms(rows[whole])))
    assert float(((got.mean - mean).abs() / (m2 / n).sqrt()).max()) < 1e-6
    torch.testing.assert_close(got.m2, m2, rtol=1e-5, atol=0)


def test_one_thread_holds_for_the_calling_thread_only():
    before = torch.get_num_threads()
    entered, leave, seen = threading.Event(), threading.Event(), {}

    def inside() -> None:
        with one_thread():
            seen["inside"] = torch.get_num_threads()
            x = torch.arange(100_000, dtype=torch.float32)
            seen["ran"] = torch.equal(x * 2, x + x)
            entered.set()
            leave.wait(10)
        seen["after"] = torch.get_num_threads()

    t = threading.Thread(target=inside)
    t.start()
    assert entered.wait(10)
    assert torch.get_num_threads() == before  # this thread's count is not the other's
    leave.set()
    t.join()
    assert seen["ran"] and seen["after"] == before
    if "OpenMP" in torch.__config__.parallel_info() and before > 1:
        assert seen["inside"] == 1


def packed(batch: int, pos: int, every: int, offset: int = 0) -> torch.Tensor:
    """A packed batch's mask: every token kept but each document's first, one in `every`."""
    keep = torch.ones(batch, pos, dtype=torch.bool)
    keep.view(-1)[offset::every] = False
    return keep


MASKS = {
    "documents of 700 tokens": lambda b, p: packed(b, p, 700),
    "the first and last rows dropped": lambda b, p: packed(b, p, b * p - 1),
    "every row kept": lambda b, p: torch.ones(b, p, dtype=torch.bool),
    "a run of one": lambda b, p: packed(b, p, 600) & packed(b, p, 600, offset=2),
}


@pytest.mark.parametrize("mask_of", list(MASKS))
@pytest.mark.parametrize("cast", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(4, 1000, 24), (3, 900, 4, 6), (1, 3000, 8)], ids=["rows", "heads", "one"])
def test_rows_copied_run_by_run_into_a_buffer_equal_boolean_mask_indexing(mask_of, cast, shape):
    """Long runs of kept rows (a packed batch's): each run copied and cast into the buffer; the
    bytes must be those of boolean-mask indexing then `.to` (a run cut short, shifted by one, or
    written to the wrong place leaves the buffer's NaN or another row there)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 1e3
    mask = MASKS[mask_of](*shape[:2])
    want = x[mask].to(cast)
    kept = KeptRows()
    assert len(kept.runs(mask)) * token_rows._RUN_ROWS <= int(mask.sum())  # the run-by-run copy is taken
    buffer = torch.full(want.shape, float("nan"), dtype=cast)  # what a reused buffer held before
    got = select_tokens(x, mask, 1, kept, cast=cast, out=buffer)
    assert got is buffer
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    fresh = select_tokens(x, mask, 1, KeptRows(), cast=cast)  # no buffer: the same copies into a new one
    assert fresh.dtype == cast and torch.equal(fresh.view(torch.uint8), want.view(torch.uint8))
