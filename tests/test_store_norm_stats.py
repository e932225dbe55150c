"""Normalisation statistics per point: per-dimension mean and variance and the mean squared row norm,
in the manifest, equal to a float64 recomputation from the rows the store holds (several shards, two
ranks merged, bfloat16 and float16, rows with NaN/Inf left out), and refused when the manifest's
copy of them is damaged. The reference reads the stored rows (`store.tensor`) and computes in
float64 with the textbook formulas; nothing of it comes from `PointStats`."""

from __future__ import annotations

import base64
import json
import struct
import math

import pytest
import torch

from hookscope.cli import main
from hookscope.errors import StoreError
from hookscope.store import PointStats, ShardWriter, merge_rank_manifests, open_store

POINTS = {"blocks.0.resid_post": (torch.bfloat16, (24,)), "blocks.0.mlp.out": (torch.float16, (3, 8))}


def make_rows(batch: int, name: str) -> torch.Tensor:
    """Rows whose dimensions have means far from 0 beside their spread (what a residual stream's
    massive dimensions look like), with NaN / Inf in a few rows."""
    dtype, shape = POINTS[name]
    g = torch.Generator().manual_seed(batch * 7 + len(name))
    width = math.prod(shape)
    offset = torch.linspace(-300, 300, width, dtype=torch.float64)
    rows = offset + torch.randn(50, width, generator=g, dtype=torch.float64) * torch.linspace(0.5, 4, width)
    if batch % 3 == 1:
        rows[batch % 50, batch % width] = float("nan")
        rows[(batch + 7) % 50, 0] = float("inf")
    return rows.reshape(50, *shape).to(dtype)


def write(out, batches, rank=0, world_size=1):
    with ShardWriter(out, {"test": "norm stats"}, shard_rows=100, rank=rank, world_size=world_size) as w:
        for b in batches:
            w.write(b, {n: make_rows(b, n) for n in POINTS}, {"token_ids": torch.arange(b * 50, b * 50 + 50)})


def reference(stored: torch.Tensor) -> dict:
    """float64 over the entirely finite rows: mean, population variance, mean squared L2 norm."""
    x = stored.reshape(len(stored), -1).double()
    x = x[torch.isfinite(x).all(dim=1)]
    mean = x.sum(0) / len(x)
    return {"rows": len(x), "mean": mean, "var": ((x - mean) ** 2).sum(0) / len(x),
            "msn": float((x**2).sum(1).mean()), "norm_mean": float(x.norm(dim=1).mean())}


def assert_matches(stats: PointStats, stored: torch.Tensor) -> None:
    want = reference(stored)
    assert stats.norm_count == want["rows"]
    std = want["var"].sqrt()
    # the mean to a millionth of the spread, though it is up to 600 spreads from 0
    assert float(((stats.mean - want["mean"]).abs() / std).max()) < 1e-6
    assert torch.allclose(stats.var, want["var"], rtol=1e-5, atol=0)
    assert stats.std.shape == want["var"].shape
    assert stats.mean_squared_norm == pytest.approx(want["msn"], rel=1e-6)
    assert stats.norm_mean == pytest.approx(want["norm_mean"], rel=1e-6)


def test_one_process_several_shards(tmp_path):
    write(tmp_path / "s", range(9))  # shards of 2 batches and a last one of 1
    store = open_store(tmp_path / "s")
    assert store.num_shards == 5
    for name in POINTS:
        assert_matches(store.stats[name], store.tensor(name))
        assert store.stats[name].nonfinite == 3 * 2  # batches 1, 4, 7: a NaN and an Inf each


def test_two_ranks_merged(tmp_path):
    out = tmp_path / "ranks"
    for rank in (1, 0):
        write(out, [b for b in range(11) if b % 2 == rank], rank=rank, world_size=2)
    merge_rank_manifests(out, 2)
    store = open_store(out)
    assert {s.rank for s in store.manifest.shards} == {0, 1}
    for name in POINTS:
        assert_matches(store.stats[name], store.tensor(name))


def test_merging_in_any_order_agrees(tmp_path):
    """Chan's update: the same statistics (to float64 rounding) whatever the grouping."""
    parts = [PointStats.of(make_rows(b, "blocks.0.resid_post")) for b in range(6)]
    left = parts[0]
    for p in parts[1:]:
        left = left.merge(p)
    right = parts[5]
    for p in parts[4::-1]:
        right = p.merge(right)
    pairs = parts[0].merge(parts[1]).merge(parts[2].merge(parts[3]).merge(parts[4].merge(parts[5])))
    for other in (right, pairs):
        assert other.norm_count == left.norm_count
        assert torch.allclose(other.mean, left.mean, rtol=1e-13, atol=0)
        assert torch.allclose(other.m2, left.m2, rtol=1e-12, atol=0)
    assert PointStats().merge(left) == left and left.merge(PointStats()) == left


def test_a_batch_of_only_bad_rows_adds_nothing():
    bad = torch.full((4, 3), float("nan"))
    good = torch.randn(10, 3)
    merged = PointStats.of(bad).merge(PointStats.of(good))
    assert merged.norm_count == 10 and merged.nonfinite == 12
    assert torch.allclose(merged.mean, good.double().mean(0), atol=1e-6)


def test_the_manifest_keeps_them_exactly_and_refuses_damaged_ones(tmp_path):
    write(tmp_path / "s", range(4))
    path = tmp_path / "s" / "manifest.json"
    store = open_store(tmp_path / "s")
    raw = json.loads(path.read_text())
    assert set(raw["stats"]["blocks.0.mlp.out"]) >= {"mean", "m2"}
    # the totals are the shards' merged, bit for bit (the manifest's check), and survive the round trip
    again = PointStats.from_json(raw["stats"]["blocks.0.mlp.out"], "x")
    assert again == store.stats["blocks.0.mlp.out"]
    for damage, message in [
        (lambda s: s.update(mean=s["mean"][:-32], m2=s["m2"][:-32]), "21 dimensions, the point has 24"),
        (lambda s: s.update(mean=s["mean"][:-12]), "183 bytes, not a whole number of float64"),
        (lambda s: s.update(m2=base64.b64encode(bytes(8)).decode()), "mean has 24 dimensions, m2 1"),
        (lambda s: s.update(mean="not base64!"), "not base64"),
        (lambda s: s.update(m2=base64.b64encode(struct.pack("<24d", *[-1.0] * 24)).decode()), "negative"),
    ]:
        bad = json.loads(json.dumps(raw))
        damage(bad["shards"][0]["stats"]["blocks.0.resid_post"])
        path.write_text(json.dumps(bad))
        with pytest.raises(StoreError, match=message):
            open_store(tmp_path / "s")
    bad = json.loads(json.dumps(raw))
    bad["stats"]["blocks.0.resid_post"]["mean"] = raw["stats"]["blocks.0.mlp.out"]["mean"]  # 24 values, wrong ones
    path.write_text(json.dumps(bad))
    with pytest.raises(StoreError, match="disagree with the sum of the shards"):
        open_store(tmp_path / "s")


def as_written_before(store_dir) -> None:
    """The store's manifest as a hookscope before the per-dimension statistics wrote it."""
    path = store_dir / "manifest.json"
    raw = json.loads(path.read_text())
    for stats in [raw["stats"], *(s["stats"] for s in raw["shards"])]:
        for s in stats.values():
            del s["mean"], s["m2"]
    path.write_text(json.dumps(raw))


def test_a_store_written_before_the_per_dimension_stats_opens(tmp_path, capsys):
    write(tmp_path / "s", range(3))
    as_written_before(tmp_path / "s")
    store = open_store(tmp_path / "s")
    st = store.stats["blocks.0.resid_post"]
    assert st.mean is None and st.var is None and st.norm_count == 150 - 2
    assert st.mean_squared_norm == pytest.approx(reference(store.tensor("blocks.0.resid_post"))["msn"], rel=1e-6)
    assert main(["inspect", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "blocks.0.resid_post" in out and "per-dim" not in out


def test_resuming_a_store_without_them_keeps_the_rest_exact(tmp_path):
    """A store written before the per-dimension statistics, extended now: its totals cannot know the
    old rows' per-dimension sums, so they stay absent (never a mean of the new rows passed off as the
    store's), while the norm statistics still cover every row."""
    write(tmp_path / "s", range(3))
    as_written_before(tmp_path / "s")
    write(tmp_path / "s", range(3, 6))  # resumes the store with batches 3-5
    store = open_store(tmp_path / "s")
    assert len(store) == 300
    st = store.stats["blocks.0.resid_post"]
    assert st.mean is None and st.norm_count == reference(store.tensor("blocks.0.resid_post"))["rows"]
    assert st.mean_squared_norm == pytest.approx(reference(store.tensor("blocks.0.resid_post"))["msn"], rel=1e-6)
    assert store.manifest.shards[-1].stats["blocks.0.resid_post"].mean is not None  # the new shard has them


def test_inspect_shows_a_summary(tmp_path, capsys):
    write(tmp_path / "s", range(3))
    store = open_store(tmp_path / "s")
    assert main(["inspect", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    st = store.stats["blocks.0.resid_post"]
    line = next(x for x in out.splitlines() if "blocks.0.resid_post" in x)
    assert f"mean squared norm {st.mean_squared_norm:.4g}" in line
    assert f"per-dim mean {float(st.mean.min()):.3g}..{float(st.mean.max()):.3g}" in line
