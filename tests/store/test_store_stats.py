"""The writer thread's work per batch: the per-point statistics (store/stats.py) are the same
floats, bit for bit, as the plain formula over the rows that are entirely finite, whatever the batch
holds; a shard's checksum is that of its bytes, whether the file can be memory-mapped or not."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest
import torch
import xxhash

from hookscope.errors import StoreError
from hookscope.store import ShardWriter, open_store
from hookscope.store import checksum as checksum_module
from hookscope.store import fs as fs_module
from hookscope.store.checksum import checksum_of
from hookscope.store.stats import PointStats, count_nonfinite


def reference(rows: torch.Tensor) -> PointStats:
    """The plain formula (the writer's before it took one pass): a float32 copy, isfinite per value,
    the norms of the entirely finite rows selected by a boolean index, summed in float64."""
    flat = rows.reshape(rows.shape[0], -1).float()
    finite = torch.isfinite(flat)
    whole = finite.all(dim=1)
    norms = flat[whole].norm(dim=1).double()
    return PointStats(int((~finite).sum()), int(whole.sum()), float(norms.sum()), float((norms**2).sum()))


def poisoned(rows: torch.Tensor, seed: int, bad_rows: int) -> torch.Tensor:
    """`rows` with NaN, +Inf and -Inf put in `bad_rows` random rows (several in some rows)."""
    g = torch.Generator().manual_seed(seed)
    out = rows.clone()
    flat = out.reshape(out.shape[0], -1)
    picked = torch.randperm(flat.shape[0], generator=g)[:bad_rows]
    for k, row in enumerate(picked.tolist()):
        cols = torch.randint(0, flat.shape[1], (1 + k % 3,), generator=g).tolist()
        for col, value in zip(cols, (float("nan"), float("inf"), float("-inf")), strict=False):
            flat[row, col] = value
    return out


def random_rows(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)


CASES = {
    "bf16 finite": lambda: random_rows((4096, 96), torch.bfloat16, 0),
    "bf16 NaN/Inf rows": lambda: poisoned(random_rows((4096, 96), torch.bfloat16, 1), 1, 37),
    "f16 NaN/Inf rows": lambda: poisoned(random_rows((1000, 33), torch.float16, 2), 2, 5),
    "f32 finite": lambda: random_rows((777, 130), torch.float32, 3),
    "f32 NaN/Inf rows": lambda: poisoned(random_rows((777, 130), torch.float32, 4), 4, 100),
    "f32 every row bad": lambda: poisoned(random_rows((40, 8), torch.float32, 5), 5, 40),
    "per-head rows": lambda: poisoned(random_rows((300, 4, 16), torch.bfloat16, 6), 6, 9),
    "one value per row": lambda: poisoned(random_rows((500,), torch.float32, 7), 7, 3),
    # finite values whose squares overflow float32: an infinite norm from an entirely finite row
    "f32 overflowing squares": lambda: torch.tensor([[3e38, 3e38], [1.0, 2.0], [float("nan"), 1.0]]),
    # finite float64 values past float32's range count as non-finite (they are Inf in float32)
    "f64 past float32's range": lambda: torch.tensor(
        [[1e300, 1.0], [1.0, 2.0], [-1e39, 0.0]], dtype=torch.float64
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_stats_equal_the_plain_formula_bit_for_bit(case):
    rows = CASES[case]()
    got, want = PointStats.of(rows), reference(rows)
    # compare the floats' bits: equal values computed in another order would differ in the last bit
    assert dataclasses.astuple(got)[:4] == dataclasses.astuple(want)[:4]
    for field in ("norm_sum", "norm_sumsq"):
        assert torch.tensor(getattr(got, field), dtype=torch.float64).view(torch.int64) == torch.tensor(
            getattr(want, field), dtype=torch.float64
        ).view(torch.int64)


def test_the_poisoned_cases_hold_what_they_say():
    """The relation the cases rest on, so that a vacuous case cannot pass: bad rows are really there."""
    rows = CASES["bf16 NaN/Inf rows"]()
    got = PointStats.of(rows)
    assert got.norm_count == 4096 - 37 and got.nonfinite >= 37
    assert PointStats.of(CASES["f32 every row bad"]()).norm_count == 0
    assert PointStats.of(CASES["f64 past float32's range"]()).nonfinite == 2
    assert PointStats.of(CASES["f32 overflowing squares"]()).norm_sum == float("inf")


def test_count_nonfinite_counts_each_value():
    x = torch.zeros(50, 7, dtype=torch.bfloat16)
    x[3, 1], x[3, 2], x[10, 0], x[49, 6] = float("nan"), float("inf"), float("-inf"), float("nan")
    assert count_nonfinite(x) == 4
    assert count_nonfinite(torch.zeros(5)) == 0 and count_nonfinite(torch.arange(5)) == 0


def written(out: Path, **options) -> list[tuple[str, int, str, str]]:
    with ShardWriter(out, {"k": 1}, shard_rows=64, **options) as w:
        for i in range(5):
            w.write(i, {"p": random_rows((40, 24), torch.bfloat16, i)}, {"token_ids": torch.arange(40)})
    return [(s.file, s.bytes, s.algorithm, s.checksum) for s in w.manifest.shards]


REFERENCE = {
    "sha256": lambda data: hashlib.sha256(data).hexdigest(),
    "xxh3_128": lambda data: xxhash.xxh3_128(data).hexdigest(),
}


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
def test_shard_checksums_are_those_of_the_files_written(tmp_path: Path, algorithm: str):
    """Checksummed while written, from the tensors' memory: the digest of the bytes on disk."""
    entries = written(tmp_path / "s", checksum=algorithm)
    assert len(entries) == 3
    for file, size, named, digest in entries:
        data = (tmp_path / "s" / file).read_bytes()
        assert (size, named, digest) == (len(data), algorithm, REFERENCE[algorithm](data))
    assert open_store(tmp_path / "s", verify=True).num_shards == 3


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
def test_checksum_of_a_file_mapped_or_read(tmp_path: Path, monkeypatch, algorithm: str):
    data = bytes(range(256)) * 40_000
    (tmp_path / "f").write_bytes(data)
    with (tmp_path / "f").open("rb") as f:
        mapped = checksum_of(f, algorithm)

    def unmappable(*args, **kwargs):
        raise OSError(19, "No such device")  # what a FUSE mount in direct-I/O mode answers

    monkeypatch.setattr(checksum_module.mmap, "mmap", unmappable)
    with (tmp_path / "f").open("rb") as f:
        read = checksum_of(f, algorithm)
    assert mapped == read == (len(data), REFERENCE[algorithm](data))


@pytest.mark.parametrize("start", [0, 5, 4097])
def test_sha256_of_hashes_what_is_left_of_the_file(tmp_path: Path, start: int):
    data = bytes(range(256)) * 40
    (tmp_path / "f").write_bytes(data)
    (tmp_path / "empty").write_bytes(b"")
    with (tmp_path / "f").open("rb") as f:
        f.seek(start)
        assert fs_module.sha256_of(f) == (len(data) - start, hashlib.sha256(data[start:]).hexdigest())
        assert f.read() == b""  # read to the end either way
    with (tmp_path / "empty").open("rb") as f:
        assert fs_module.sha256_of(f) == (0, hashlib.sha256(b"").hexdigest())


def test_a_store_of_sha256_shards_verifies_and_resumes_with_xxh3_shards(tmp_path: Path):
    """Stores written before xxh3_128 name SHA-256 per shard: they open, verify and resume, the new
    shards beside them named xxh3_128, the rows and shard bytes those of a store written in one go."""

    def batch(i: int):
        return {"p": random_rows((40, 24), torch.bfloat16, i)}, {"token_ids": torch.arange(40) + 40 * i}

    with ShardWriter(tmp_path / "old", {"k": 1}, shard_rows=64, checksum="sha256") as w:
        for i in range(3):
            w.write(i, *batch(i))
    with ShardWriter(tmp_path / "old", {"k": 1}, shard_rows=64) as w:  # resumed by today's writer
        assert w.done_batches == frozenset(range(3))
        for i in range(3, 6):
            w.write(i, *batch(i))
    store = open_store(tmp_path / "old", verify=True)
    assert [s.algorithm for s in store.manifest.shards] == ["sha256", "sha256", "xxh3_128", "xxh3_128"]
    assert torch.equal(store.tensor("p"), torch.cat([batch(i)[0]["p"] for i in range(6)]))
    for s in store.manifest.shards:
        assert s.checksum == REFERENCE[s.algorithm]((tmp_path / "old" / s.file).read_bytes())
    first = tmp_path / "old" / store.manifest.shards[0].file
    data = bytearray(first.read_bytes())
    data[-1] ^= 0xFF
    first.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"shard-r000-000000.*checksum \(sha256\) differs"):
        open_store(tmp_path / "old", verify=True)
