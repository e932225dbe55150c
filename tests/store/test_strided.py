"""Shards mapped side by side at one stride (store/strided.py): every row reads back as the bytes
the file holds, whatever the header length and row size; a file that cannot land on a run's stride
starts a new run; a dataset over such runs yields exactly what mapping shard by shard yields; a
window's own mappings are unmapped with it."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

from hookscope.store import ShardWriter, open_store
from hookscope.store import mapper as mapper_module
from hookscope.store.strided import Runs

pytestmark = pytest.mark.skipif(not Runs.supported(), reason="strided mapping is Linux only")


def write_file(path, header: int, rows: int, row_bytes: int, seed: int) -> np.ndarray:
    """A file of `header` arbitrary bytes and then `rows` random rows: the rows, as written."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, row_bytes), dtype=np.uint8)
    with open(path, "wb") as f:
        f.write(rng.integers(0, 256, size=header, dtype=np.uint8).tobytes())
        f.write(data.tobytes())
    return data


@pytest.mark.parametrize(
    "row_shape,dtype",
    [
        ((768,), torch.float16),
        ((2048,), torch.float16),
        ((769,), torch.float16),
        ((3,), torch.int32),
        ((4, 6), torch.bfloat16),
        ((5,), torch.uint8),
    ],
)
def test_each_row_reads_back_as_the_files_bytes(tmp_path, row_shape, dtype):
    row_bytes = math.prod(row_shape) * torch.empty((), dtype=dtype).element_size()
    headers = [304, 296, 304, 4096, 8, 304, 5000, 296]  # equal, 8 apart, page sized, odd
    rows = [40, 40, 40, 7, 40, 1, 40, 33]
    files = [tmp_path / f"s{i}" for i in range(len(headers))]
    written = [
        write_file(f, h, n, row_bytes, i)
        for i, (f, h, n) in enumerate(zip(files, headers, rows, strict=True))
    ]
    runs = Runs(sum(f.stat().st_size for f in files), len(files), row_shape, dtype)
    placed = [runs.add(f, h) for f, h in zip(files, headers, strict=True)]
    for (run, first), data, n in zip(placed, written, rows, strict=True):
        got = runs.tensor(run)[first : first + n].reshape(n, -1).view(torch.uint8).numpy()
        assert np.array_equal(got, data)
    # files whose columns start at the same offset share a run (and never overlap in it)
    by_header: dict[int, set[int]] = {}
    for (run, _), h in zip(placed, headers, strict=True):
        by_header.setdefault(h, set()).add(run)
    assert all(len(r) == 1 for r in by_header.values())
    spans = sorted((run, first, first + n) for (run, first), n in zip(placed, rows, strict=True))
    assert all(a[0] != b[0] or a[2] <= b[1] for a, b in zip(spans, spans[1:], strict=False))
    # a page-multiple stride cannot absorb headers 8 bytes apart: they go to different runs
    if row_bytes % 4096 == 0:
        assert placed[0][0] != placed[1][0]


def test_rows_land_on_2mib_boundaries_where_the_page_cache_has_2mib_folios(tmp_path):
    """Each file is mapped 2 MiB aligned (its address and its offset in the file agree mod 2 MiB,
    what a 2 MiB page-table entry needs) when the stride allows it cheaply."""
    row_shape, dtype = (768,), torch.float16
    files = [tmp_path / f"s{i}" for i in range(3)]
    for i, f in enumerate(files):
        write_file(f, 304, 2048, 1536, i)
    runs = Runs(sum(f.stat().st_size for f in files), 3, row_shape, dtype)
    for f in files:
        run, first = runs.add(f, 304)
        address = runs.tensor(run)[first].data_ptr() - 304
        assert address % (2 << 20) == 0


def gappy_store(path):
    """A store whose shards' headers differ in length (their batch numbers, cubes, grow in digits),
    with rows of 4,096 bytes: shards that cannot share a stride, so windows span several runs."""
    with ShardWriter(path, {"test": "gappy"}, shard_rows=6) as w:
        for i in range(40):
            x = torch.arange(i * 3, i * 3 + 3, dtype=torch.float32)[:, None] + torch.zeros(1, 2048)
            w.write(i**3, {"x": x.to(torch.float16)}, {"token_ids": torch.arange(i * 3, i * 3 + 3)})
    return open_store(path)


@pytest.mark.parametrize(
    "kw",
    [
        dict(batch_size=8),
        dict(batch_size=8, shuffle=False),
        dict(),
        dict(shuffle=False),
        dict(batch_size=5, split="train"),
    ],
)
@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.slow
def test_a_dataset_over_several_runs_yields_what_shard_by_shard_mapping_yields(
    tmp_path, monkeypatch, kw, keep
):
    store = gappy_store(tmp_path / "s")
    if not keep:
        monkeypatch.setattr(mapper_module, "ram_bytes", lambda: 0)
    ds = store.dataset(["x", "token_ids"], seed=3, buffer_rows=20, **kw)
    strided = [dict(b) for b in ds]
    assert ds._mapper.strided
    if keep:
        assert len(ds._mapper.runs["x"].runs) >= 2  # the headers really put shards in different runs
    plain = store.dataset(["x", "token_ids"], seed=3, buffer_rows=20, **kw)
    monkeypatch.setattr(mapper_module.Runs, "supported", staticmethod(lambda: False))
    one_by_one = list(plain)
    assert not plain._mapper.strided
    assert len(strided) == len(one_by_one) > 0
    for a, b in zip(strided, one_by_one, strict=True):
        if "batch_size" in kw and kw.get("shuffle", True):  # a shuffled batch is its rows as a set,
            a, b = (by_token(t) for t in (a, b))  # grouped by part (runs here, shards there)
        assert torch.equal(a["x"], b["x"]) and torch.equal(a["token_ids"], b["token_ids"])
        # every row is its own: x holds the row's index, as token_ids does
        assert torch.equal(a["x"][..., 0].float(), a["token_ids"].float())
    ids = torch.cat([b["token_ids"].reshape(-1) for b in strided]).tolist()
    assert len(ids) == len(set(ids))


def by_token(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    order = torch.argsort(batch["token_ids"])
    return {k: v[order] for k, v in batch.items()}


def mapped_regions() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps")
def test_a_windows_mappings_go_with_it_when_not_kept(tmp_path, monkeypatch):
    store = gappy_store(tmp_path / "s")
    monkeypatch.setattr(mapper_module, "ram_bytes", lambda: 0)
    ds = store.dataset("x", seed=0, buffer_rows=20, batch_size=8)

    def settled_regions() -> int:  # once the next epoch's first window, read ahead, is mapped
        if ds._prefetcher.ahead is not None:
            ds._prefetcher.ahead.read.result()
        return mapped_regions()

    for _ in ds:  # warm up: imports, threads, allocator arenas
        pass
    before = settled_regions()
    for _ in range(3):
        for _ in ds:
            pass
    assert settled_regions() <= before + 2
