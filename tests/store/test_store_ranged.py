"""Ranged reads of a store at a URL (issue 18 item 2): a shard's header with one small GET, then only
the byte ranges of the columns and rows asked for, through a bounded block cache with readahead.

Every read is compared with the same store written to a local directory and read there (safetensors'
own memory map: an independent reader), and the bytes fetched are counted at the filesystem seam.
memory:// (fsspec's in-process filesystem) runs everywhere; the s3:// tests use the moto server of
test_store_s3.py and skip without `moto[server]` and `s3fs`."""

from __future__ import annotations

import math
from pathlib import Path

import fsspec
import gate
import pytest
import torch
from faultkit import damage
from gate import skip_unless

from hookscope.errors import StoreError
from hookscope.store import ShardWriter, open_store

needs_s3 = skip_unless("s3")
if gate.problem("s3") is None:
    from test_store_s3 import bucket, s3  # noqa: F401 - fixtures

WIDE, NARROW = 256, 8  # p: 256 float32 = 1 KiB a row, q: 8 bfloat16 = 16 B a row
SHARD_ROWS = 100  # shards of ~100 KiB, larger than the 64 KiB first GET, so ranges are visible
BLOCK = 4096
# the first GET of a shard, for its header: checks.HEAD_BYTES, and room for its per-dimension
# statistics (per point: its name, 64 bytes of JSON, two float64 vectors in base64)
HEADER_GET = (16 << 10) + sum(
    len(name) + 64 + 2 * 4 * math.ceil(8 * width / 3) for name, width in (("p", WIDE), ("q", NARROW))
)


def write(out: str, settings: dict | None = None, batches: int = 12) -> None:
    gen = torch.Generator().manual_seed(0)
    with ShardWriter(out, settings or {"test": "ranged"}, shard_rows=SHARD_ROWS) as w:
        for i in range(batches):
            rows = 30 + 7 * (i % 3)
            w.write(
                i,
                {
                    "p": torch.randn(rows, WIDE, generator=gen),
                    "q": torch.randn(rows, NARROW, generator=gen).to(torch.bfloat16),
                },
                {"token_ids": torch.arange(rows) + 1000 * i},
            )


@pytest.fixture
def blocks(monkeypatch):
    monkeypatch.setenv("HOOKSCOPE_BLOCK_BYTES", str(BLOCK))


_names = iter(range(10**6))


@pytest.fixture
def pair(tmp_path, blocks) -> tuple[str, Path]:
    """(memory:// URL, local directory) of the same store."""
    url = f"memory://ranged/{next(_names)}"
    write(url)
    write(str(tmp_path / "local"))
    return url, tmp_path / "local"


def fetched(store) -> tuple[int, int]:
    return store.fs.bytes_read, store.fs.requests


def settle(store, timeout: float = 30) -> None:
    """Wait for the background readahead to finish (so request counts are not racing it)."""
    for future in list(store._ranged.ahead.values()):
        future.exception(timeout)


def test_column_and_row_reads_equal_the_local_store_and_fetch_only_their_bytes(pair):
    url, local_dir = pair
    remote, local = open_store(url), open_store(local_dir)
    assert remote.num_shards == local.num_shards >= 4 and len(remote) == len(local)
    total = sum(s.bytes for s in remote.manifest.shards)

    # one column of one shard: the GETs of headers and its own bytes, nothing more
    before = fetched(remote)[0]
    got = remote.load_shard(2, ["q"])
    assert torch.equal(got["q"], local.load_shard(2, ["q"])["q"])
    column = remote.manifest.shards[2].rows * NARROW * 2
    # headers come in one batch with the next shards' (2 and 3 of 4); blocks are cut from the column's start
    assert fetched(remote)[0] - before == 2 * HEADER_GET + column
    assert fetched(remote)[0] - before < remote.manifest.shards[2].bytes

    # a window of rows across a shard boundary: only those rows of that column
    start = remote.first_row(1) - 13
    settle(remote)
    before = fetched(remote)[0]
    window = remote.rows(start, start + 40, ["p"])
    assert torch.equal(window["p"], local.tensor("p")[start : start + 40])
    assert torch.equal(local.rows(start, start + 40, ["p"])["p"], local.tensor("p")[start : start + 40])
    headers = 2 * HEADER_GET  # shards 0 and 1's headers were not read yet
    assert fetched(remote)[0] - before <= headers + 40 * WIDE * 4 + 4 * BLOCK

    # map-style rows, every column, and a whole column
    for row in (0, start, len(local) - 1, -1):
        got, want = remote[row], local[row]
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    for i in range(remote.num_shards):
        remote.header(i)
    before = fetched(remote)[0]
    assert torch.equal(remote.tensor("token_ids"), local.tensor("token_ids"))
    assert fetched(remote)[0] - before < total / 10  # 8 B a row of the ~1 KiB a row the store holds
    assert remote.rows(5, 5, ["q"])["q"].shape == (0, NARROW)
    with pytest.raises(StoreError, match="rows 0:"):
        remote.rows(0, len(remote) + 1)


def in_row_order(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch's rows sorted by their bytes (a canonical order for comparing batches as sets)."""
    keys = [bytes(r) for r in batch["p"].reshape(len(batch["p"]), -1).view(torch.uint8).numpy()]
    order = torch.tensor(sorted(range(len(keys)), key=keys.__getitem__))
    return {k: v[order] for k, v in batch.items()}


def test_the_shuffled_dataset_reads_a_url_unchanged(pair):
    url, local_dir = pair
    remote, local = open_store(url), open_store(local_dir)
    for kwargs in (
        {"seed": 4, "buffer_rows": 150, "batch_size": 32},
        {"seed": 1, "buffer_rows": 90},
        {"shuffle": False, "batch_size": 50, "split": "val", "prefetch": False},
    ):
        want = list(local.dataset(["p", "q"], **kwargs))
        got = list(remote.dataset(["p", "q"], **kwargs))
        assert len(got) == len(want) > 0
        if "batch_size" in kwargs and kwargs.get("shuffle", True):
            # a shuffled batch is its slice of the stream as a set: grouped by shard from a URL,
            # by run of shards mapped side by side locally
            got, want = [in_row_order(b) for b in got], [in_row_order(b) for b in want]
        assert all(torch.equal(a[k], b[k]) for a, b in zip(got, want, strict=True) for k in ("p", "q"))
    # a dataset of one point fetches that point's bytes, not the other columns'
    fresh = open_store(url)
    rows = sum(len(b) for b in fresh.dataset("q", batch_size=64))
    assert rows == len(local)
    assert fetched(fresh)[0] <= fresh.num_shards * (HEADER_GET + 2 * BLOCK) + len(local) * NARROW * 2


def test_a_window_read_ahead_is_fetched_in_the_background_and_served_from_the_cache(pair):
    url, local_dir = pair
    store, local = open_store(url), open_store(local_dir)
    assert store.num_shards >= 4
    store.read_ahead([3, 1], ["q"])  # what the shuffled dataset asks for before a window
    settle(store)
    ahead = fetched(store)
    assert ahead[0] > 0  # fetched before any load
    for i in (3, 1):  # not a sequential scan: no further readahead of its own
        assert torch.equal(store.load_shard(i, ["q"])["q"], local.load_shard(i, ["q"])["q"])
    assert fetched(store) == ahead  # both shards came from the cache: no request after the readahead
    local.read_ahead([0, 1], ["q"])  # a local store: nothing to fetch, nothing fails
    with pytest.raises(StoreError, match="no column"):
        store.read_ahead([0], ["nope"])


def test_the_block_cache_is_bounded_and_serves_repeats(pair, monkeypatch):
    url, _ = pair
    store = open_store(url)
    first = store.load_shard(1, ["p"])["p"]
    settle(store)
    _, requests = fetched(store)
    assert torch.equal(store.load_shard(1, ["p"])["p"], first)  # held: no new GET
    assert fetched(store)[1] == requests

    monkeypatch.setenv("HOOKSCOPE_CACHE_BYTES", "3 blocks")
    with pytest.raises(StoreError, match="HOOKSCOPE_CACHE_BYTES"):
        open_store(url)
    monkeypatch.setenv("HOOKSCOPE_CACHE_BYTES", str(3 * BLOCK))
    small = open_store(url)
    small.tensor("p")
    assert 0 < small._ranged.blocks.held <= 3 * BLOCK
    settle(small)
    _, requests = fetched(small)
    small.load_shard(0, ["p"])  # long evicted: fetched again
    assert fetched(small)[1] > requests


def test_a_sequential_scan_reads_the_next_shard_ahead_and_a_jump_does_not(pair):
    url, local_dir = pair
    local = open_store(local_dir)
    store = open_store(url)
    last = store.num_shards - 1
    for i in range(last):  # a scan: the last shard's column is fetched in the background
        store.load_shard(i, ["p"])
    settle(store)
    _, requests = fetched(store)
    assert torch.equal(store.load_shard(last, ["p"])["p"], local.load_shard(last, ["p"])["p"])
    assert fetched(store)[1] == requests  # no GET: it came from the readahead

    jumping = open_store(url)
    jumping.load_shard(2, ["p"])  # not a scan: nothing read ahead
    settle(jumping)
    held = {rel for rel, _, _ in jumping._ranged.blocks._blocks}
    assert held == {jumping.manifest.shards[2].file}


RANGED_FAULTS = [
    "truncated",
    "two shards exchanged",
    "manifest lies about a shard's size",
    "manifest lies about a shard's rows",
    "header says another dtype",
]


@pytest.mark.parametrize("fault", RANGED_FAULTS)
def test_ranged_reads_refuse_damaged_objects_without_verify(blocks, fault):
    url = f"memory://ranged/{next(_names)}"
    write(url)
    damage(fsspec.filesystem("memory"), "/" + url.removeprefix("memory://"), fault)
    store = open_store(url)  # opening reads only the manifest and a listing: the damage shows on reading
    with pytest.raises(StoreError, match=r"shard-r000-00000[01]"):
        for i in range(2):
            store.load_shard(i, ["q"])
    with pytest.raises(StoreError, match=r"shard-r000-00000[01]"):
        list(store.dataset("q", batch_size=16))
    with pytest.raises(StoreError, match=r"shard-r000-00000[01]"):
        open_store(url, verify=True)


def test_a_shard_truncated_after_open_is_refused_on_the_short_read(blocks):
    url = f"memory://ranged/{next(_names)}"
    write(url)
    store = open_store(url)
    store.load_shard(1, ["q"])  # its header is known now
    fs = fsspec.filesystem("memory")
    shard = "/" + url.removeprefix("memory://") + "/shards/shard-r000-000001.safetensors"
    fs.pipe_file(shard, fs.cat_file(shard)[: -WIDE * 4 * 20])
    with pytest.raises(StoreError, match=r"shard-r000-000001.*shorter than"):
        store.load_shard(1, ["p", "token_ids"])  # blocks not cached yet, some past the new end


def test_a_lying_checksum_passes_ranged_reads_and_fails_verify(pair):
    """What a ranged read cannot check: the whole-shard checksum. The rows still come back as
    written (header, identity, sizes hold), and verify() names the shard."""
    url, local_dir = pair
    fs = fsspec.filesystem("memory")
    root = "/" + url.removeprefix("memory://")
    text = fs.cat_file(f"{root}/manifest.json").decode()
    sha = open_store(url).manifest.shards[0].checksum
    fs.pipe_file(f"{root}/manifest.json", text.replace(sha, "0" * len(sha)).encode())
    assert torch.equal(open_store(url).tensor("p"), open_store(local_dir).tensor("p"))
    with pytest.raises(StoreError, match=r"shard-r000-000000.*checksum \(xxh3_128\) differs"):
        open_store(url, verify=True)


# -- against the S3 server ----------------------------------------------------------------------------


@needs_s3
@pytest.mark.slow
def test_s3_ranged_reads_equal_the_local_store(s3, bucket, tmp_path, blocks):  # noqa: F811
    url = f"s3://{bucket}/store"
    write(url)
    write(str(tmp_path / "local"))
    remote, local = open_store(url), open_store(tmp_path / "local")
    total = sum(s.bytes for s in remote.manifest.shards)
    before, _ = fetched(remote)
    assert torch.equal(remote.tensor("q"), local.tensor("q"))
    # headers, and the 16 B a row of q (in 4 KiB blocks), not the shards' ~1 KiB a row
    got = fetched(remote)[0] - before
    assert got <= remote.num_shards * (HEADER_GET + 2 * BLOCK) + len(local) * NARROW * 2 and got < total / 4
    p = remote.load_shard(3, ["p"])["p"]  # ~100 KiB: many 4 KiB blocks in one concurrent batch
    assert torch.equal(p, local.load_shard(3, ["p"])["p"])
    start = remote.first_row(2) - 5
    assert torch.equal(
        remote.rows(start, start + 10, ["p", "token_ids"])["token_ids"],
        local.tensor("token_ids")[start : start + 10],
    )
    got = list(remote.dataset(["p"], seed=2, buffer_rows=120, batch_size=48))
    want = list(local.dataset(["p"], seed=2, buffer_rows=120, batch_size=48))
    assert len(got) == len(want) > 0
    # a shuffled batch is its slice of the stream as a set (grouped by shard from a URL)
    assert all(
        torch.equal(in_row_order(a)["p"], in_row_order(b)["p"]) for a, b in zip(got, want, strict=True)
    )
    open_store(url, verify=True)


@needs_s3
@pytest.mark.parametrize(
    "fault",
    ["truncated", "two shards exchanged", "shard from another store", "manifest lies about a shard's rows"],
)
@pytest.mark.slow
def test_s3_ranged_reads_refuse_hostile_objects(s3, bucket, blocks, fault):  # noqa: F811
    url = f"s3://{bucket}/store"
    write(url)
    root = f"{bucket}/store"
    if fault == "shard from another store":
        write(f"s3://{bucket}/other", settings={"test": "another store"})
        s3.pipe_file(
            f"{root}/shards/shard-r000-000000.safetensors",
            s3.cat_file(f"{bucket}/other/shards/shard-r000-000000.safetensors"),
        )
    else:
        damage(s3, root, fault)
    s3.invalidate_cache()
    store = open_store(url)
    with pytest.raises(StoreError, match=r"s3://.*shard-r000-00000[01]"):
        for i in range(2):
            store.load_shard(i, ["q"])
    with pytest.raises(StoreError, match=r"shard-r000-00000[01]"):
        open_store(url, verify=True)
