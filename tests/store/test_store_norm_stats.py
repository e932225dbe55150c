"""Normalisation statistics per point: per-dimension mean and variance and the mean squared row norm,
equal to a float64 recomputation from the rows the store holds (several shards, two ranks merged, a
resumed and an elastic store, bfloat16 and float16, rows with NaN/Inf left out); the vectors in each
shard's header, never in the manifest, and refused when a header's copy of them is damaged. The
reference reads the stored rows (`store.tensor`) and computes in float64 with the textbook
formulas; nothing of it comes from `PointStats`."""

from __future__ import annotations

import base64
import json
import math
import struct
import time

import pytest
import torch

from hookscope.cli import main
from hookscope.errors import StoreError
from hookscope.store import PointStats, ShardWriter, dimstats, merge_rank_manifests, open_store
from hookscope.store.stats import HEADER_KEY

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
    return {
        "rows": len(x),
        "mean": mean,
        "var": ((x - mean) ** 2).sum(0) / len(x),
        "msn": float((x**2).sum(1).mean()),
        "norm_mean": float(x.norm(dim=1).mean()),
    }


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


def header_of(data: bytes) -> tuple[dict, bytes]:
    """A safetensors file's header (JSON, in file order) and the bytes after it."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def with_header(header: dict, body: bytes, length: int | None = None) -> bytes:
    """The file of `header` and `body`, its header padded with spaces as safetensors pads it (to 8
    bytes), or to `length` bytes (the file keeps its size and its tensors' places)."""
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    pad = -len(text) % 8 if length is None else length - len(text)
    assert pad >= 0
    return struct.pack("<Q", len(text) + pad) + text + b" " * pad + body


def edit_stats(path, edit) -> None:
    """Shard `path` with its `hookscope.stats` metadata replaced by `edit(parsed JSON)` (a value
    that is not a str is written as JSON; None takes the key out), at the same size."""
    data = path.read_bytes()
    header, body = header_of(data)
    meta = header["__metadata__"]
    new = edit(json.loads(meta.pop(HEADER_KEY)))
    if new is not None:
        meta[HEADER_KEY] = new if isinstance(new, str) else json.dumps(new, separators=(",", ":"))
    path.write_bytes(with_header(header, body, int.from_bytes(data[:8], "little")))


def b64(values) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}d", *values)).decode()


def test_the_manifest_keeps_no_vector_the_shards_do(tmp_path):
    """The manifest (entries, totals) and any journal beside it hold the scalar statistics only: a
    store of 512-wide rows has bookkeeping files as long as one of 8-wide rows, entry for entry;
    each shard's own header holds its points' vectors."""
    sizes = {}
    for width in (8, 512):
        out = tmp_path / f"w{width}"
        w = ShardWriter(out, {"test": "widths"}, shard_rows=100)
        for b in range(6):
            g = torch.Generator().manual_seed(b)
            w.write(b, {"p": torch.randn(50, width, generator=g) + 1000}, {"token_ids": torch.arange(50)})
        while len(w.manifest.shards) < 3:  # every shard committed, the writer still open: its journal is live
            time.sleep(0.01)
        files = {f: f.read_bytes() for f in out.rglob("*") if f.is_file() and "shards" not in f.parts}
        journal = files[out / "manifest.journal"]  # shards 2 and 3 (the first one's commit compacts)
        assert journal.count(b"\n") == 2 and b'"norm_sumsq"' in journal
        w.close()
        files |= {f: f.read_bytes() for f in out.rglob("*") if f.is_file() and "shards" not in f.parts}
        for data in files.values():
            assert b'"mean"' not in data and b'"m2"' not in data
        raw = json.loads((out / "manifest.json").read_text())
        assert all(
            set(e["stats"]["p"]) == {"nonfinite", "norm_count", "norm_sum", "norm_sumsq"}
            for e in raw["shards"]
        )
        sizes[width] = [len(json.dumps(e)) for e in raw["shards"]]
        shard, _ = header_of((out / raw["shards"][0]["file"]).read_bytes())
        vectors = json.loads(shard["__metadata__"][HEADER_KEY])["p"]
        assert len(base64.b64decode(vectors["mean"])) == 8 * width  # float64, every dimension
    # the same but for the digits of the sums: a 504-dimension vector would add 4 KiB
    assert all(abs(a - b) < 16 for a, b in zip(sizes[8], sizes[512], strict=True))


def test_a_damaged_shard_header_is_refused_by_name(tmp_path, capsys):
    write(tmp_path / "s", range(4))
    store = open_store(tmp_path / "s")
    first = tmp_path / "s" / store.manifest.shards[0].file
    original = first.read_bytes()
    for edit, message in [
        (
            lambda s: s["blocks.0.resid_post"].update(mean=s["blocks.0.resid_post"]["mean"][:-32]) or s,
            "mean holds 21 dimensions, the point has 24",
        ),
        (lambda s: s["blocks.0.resid_post"].update(mean="not base64!") or s, "not base64"),
        (lambda s: s["blocks.0.resid_post"].update(m2=b64([-1.0] * 24)) or s, "negative sum of squares"),
        (lambda s: s["blocks.0.resid_post"].update(mean=b64([float("nan")] * 24)) or s, "non-finite"),
        (lambda s: s["blocks.0.mlp.out"].update(norm_count=1) or s, "does not cover the 98 rows"),
        (lambda s: s.pop("blocks.0.mlp.out") and s, "the manifest lists the points"),
        (lambda s: "{not json", "not valid JSON"),
        (lambda s: [s], "the manifest lists the points"),
    ]:
        edit_stats(first, edit)
        damaged = open_store(tmp_path / "s")
        assert torch.equal(damaged.tensor("token_ids"), store.tensor("token_ids"))  # the rows still read
        with pytest.raises(StoreError, match=f"shard-r000-000000.safetensors: .*{message}"):
            damaged.stats["blocks.0.resid_post"]
        first.write_bytes(original)
    edit_stats(first, lambda s: s["blocks.0.resid_post"].update(m2=b64([-1.0] * 24)) or s)
    assert main(["inspect", str(tmp_path / "s"), "--no-verify"]) != 0
    assert "shard-r000-000000.safetensors: its 'hookscope.stats' metadata" in capsys.readouterr().err


def test_a_resumed_store_merges_them_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(dimstats, "_GROUP", 2)  # shards merged in groups of 2, the groups with Chan's update
    write(tmp_path / "s", range(5))  # 2 shards and a last one of 1 batch
    write(tmp_path / "s", range(5, 9))
    store = open_store(tmp_path / "s")
    assert [s.batch_start for s in store.manifest.shards] == [0, 2, 4, 5, 7]
    for name in POINTS:
        assert_matches(store.stats[name], store.tensor(name))


def test_an_elastic_store_merges_them_exactly(tmp_path):
    """Two ranks write some batches, one process the rest (a later attempt)."""
    out = tmp_path / "s"
    for rank in (0, 1):
        write(out, [b for b in range(6) if b % 2 == rank], rank=rank, world_size=2)
    with ShardWriter(out, {"test": "norm stats"}, shard_rows=100) as w:
        assert w.generation == 1
        for b in range(11):
            if w.owns(b):
                w.write(
                    b, {n: make_rows(b, n) for n in POINTS}, {"token_ids": torch.arange(b * 50, b * 50 + 50)}
                )
    store = open_store(out)
    assert len(store) == 11 * 50 and {s.generation for s in store.manifest.shards} == {0, 1}
    for name in POINTS:
        assert_matches(store.stats[name], store.tensor(name))


def as_written_before(store_dir) -> None:
    """The store's shards as a hookscope before the per-dimension statistics wrote them (the
    manifest is as it wrote it already)."""
    for shard in (store_dir / "shards").glob("*.safetensors"):
        edit_stats(shard, lambda s: None)


def test_a_store_written_before_the_per_dimension_stats_opens(tmp_path, capsys):
    write(tmp_path / "s", range(3))
    as_written_before(tmp_path / "s")
    store = open_store(tmp_path / "s")
    st = store.stats["blocks.0.resid_post"]
    assert st.mean is None and st.var is None and st.norm_count == 150 - 2
    assert (
        "shard-r000-000000.safetensors and 1 other shard(s) were written before"
        in store.stats.missing["blocks.0.resid_post"]
    )
    want = reference(store.tensor("blocks.0.resid_post"))
    assert st.mean_squared_norm == pytest.approx(want["msn"], rel=1e-6)
    assert main(["inspect", str(tmp_path / "s"), "--no-verify"]) == 0
    out = capsys.readouterr().out
    assert "blocks.0.resid_post" in out and "per-dim mean" not in out and "were written before" in out


def test_resuming_a_store_without_them_keeps_the_rest_exact(tmp_path):
    """A store written before the per-dimension statistics, extended now: its old rows' per-dimension
    sums are unknown, so the store's stay absent (never a mean of the new rows passed off as the
    store's), while the norm statistics still cover every row."""
    write(tmp_path / "s", range(3))
    as_written_before(tmp_path / "s")
    write(tmp_path / "s", range(3, 6))  # resumes the store with batches 3-5
    store = open_store(tmp_path / "s")
    assert len(store) == 300
    st = store.stats["blocks.0.resid_post"]
    assert st.mean is None and st.norm_count == reference(store.tensor("blocks.0.resid_post"))["rows"]
    want = reference(store.tensor("blocks.0.resid_post"))
    assert st.mean_squared_norm == pytest.approx(want["msn"], rel=1e-6)
    last, _ = header_of((tmp_path / "s" / store.manifest.shards[-1].file).read_bytes())
    assert HEADER_KEY in last["__metadata__"]  # the new shards have them


def test_inspect_shows_a_summary(tmp_path, capsys):
    write(tmp_path / "s", range(3))
    store = open_store(tmp_path / "s")
    assert main(["inspect", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    st = store.stats["blocks.0.resid_post"]
    line = next(x for x in out.splitlines() if "blocks.0.resid_post" in x)
    assert f"mean squared norm {st.mean_squared_norm:.4g}" in line
    assert f"per-dim mean {float(st.mean.min()):.3g}..{float(st.mean.max()):.3g}" in line
