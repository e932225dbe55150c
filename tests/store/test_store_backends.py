"""Every store operation behaves the same wherever the store lives: a local directory, `file://`,
`memory://` (fsspec's in-process filesystem) and an S3 server (moto's, on 127.0.0.1: the `s3`
fixture of test_store_s3.py; skipped without `moto[server]` and `s3fs`). Each test runs once per
backend and compares what it reads with the rows the test itself wrote (`REF`), never with another
store read back."""

from __future__ import annotations

import hashlib
import itertools
import json

import pytest
import torch
import xxhash
from test_store_norm_stats import header_of, with_header

import hookscope as hs
from hookscope.errors import StoreError
from hookscope.store import ShardWriter, open_store
from hookscope.store.fs import open_fs
from hookscope.store.manifest import Manifest
from hookscope.store.stats import HEADER_KEY

try:
    import moto.server  # noqa: F401
    import s3fs  # noqa: F401

    HAVE_S3 = True
    from test_store_s3 import bucket, s3  # noqa: F401 - fixtures
except ImportError:
    HAVE_S3 = False

POINT = "blocks.0.resid_post"
SETTINGS = {"test": "backends", "context": 4}
BATCHES, SHARD_ROWS, UNITS = 10, 8, 6
_names = itertools.count()


def batch(i: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Batch `i`: 4 + i % 3 rows; every value distinct (no ties in a top-k), token_ids = global row."""
    first = sum(4 + j % 3 for j in range(i))
    rows = 4 + i % 3
    ids = torch.arange(first, first + rows)
    x = (ids[:, None] * UNITS + torch.arange(UNITS)).float()
    x = torch.where(ids[:, None] % 2 == 0, x, -x) / 64  # exact in float16 up to 2048 / 64
    meta = {"token_ids": ids, "doc_ids": ids // 12, "positions": ids % 12, "seq_ids": ids // 4}
    return {POINT: x.half()}, meta


def reference() -> dict[str, torch.Tensor]:
    parts = [batch(i) for i in range(BATCHES)]
    out = {POINT: torch.cat([p[0][POINT] for p in parts])}
    for name in parts[0][1]:
        out[name] = torch.cat([p[1][name] for p in parts])
    return out


REF = reference()
ROWS = len(REF["token_ids"])


def write(location: str, batches: range = range(BATCHES), interrupt: bool = False) -> None:
    writer = ShardWriter(location, SETTINGS, shard_rows=SHARD_ROWS)
    try:
        with writer:
            for i in batches:
                if writer.owns(i):
                    writer.write(i, *batch(i))
            if interrupt:  # Ctrl-C: the unfinished shard is dropped, the resume writes it again
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass


@pytest.fixture(params=["local", "file", "memory", "s3"])
def location(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "store")
    if request.param == "file":
        return f"file://{tmp_path / 'store'}"
    if request.param == "memory":
        return f"memory://backends/{next(_names)}"
    if not HAVE_S3:
        pytest.skip("needs moto[server] and s3fs: pip install 'hookscope[dev]'")
    return f"s3://{request.getfixturevalue('bucket')}/store"


@pytest.fixture
def store(location):
    write(location)
    return open_store(location)


# SHA-256 of each file of this store as b05e947's writer wrote it (before the filesystem interface):
# the shards are unchanged, byte for byte, on every backend, once the per-dimension statistics added
# to their headers since are taken out; the manifest too, once each shard's checksum is named as
# b05e947 named it (SHA-256 of that shard; shards are now checksummed with xxh3_128)
SHARD = "shards/shard-r000-{:06d}.safetensors"
WRITTEN_BY_B05E947 = {
    "manifest.json": "40b26d7ec3e11be36a3860d9d7c1b5ecc42e9294299076d4d149cfd2ad29c5b9",
    SHARD.format(0): "8da7e5468741ee8db6a4cccf9bb040b0f9496a487c25afd42bc0d625cd7296b2",
    SHARD.format(1): "bb689ac7abae374595fea2e804117bf2abca248a3fac58fc80e1d2acbb5ce8d7",
    SHARD.format(2): "3a4e704ea4c34cc3885f597cedc18f8c5eacc17059e58f93d6bb2817ad593111",
    SHARD.format(3): "1d0090620b17428dda538431038189bbc71ad84c523de200f37ec6e87a087bb4",
    SHARD.format(4): "85e567d596e053cea2a08a665455dec25414cc5fa6fe957d8d7aab0650ca83a5",
}


@pytest.mark.slow
def test_the_files_are_those_the_earlier_writer_wrote(store, location):
    fs = open_fs(location)
    assert fs.list("shards") == sorted(
        name.removeprefix("shards/") for name in WRITTEN_BY_B05E947 if name.startswith("shards/")
    )
    got = {}
    raw = json.loads(fs.read("manifest.json"))
    for entry in raw["shards"]:
        data = fs.read(entry["file"])
        assert entry.pop("xxh3_128") == xxhash.xxh3_128(data).hexdigest()
        header, body = header_of(data)
        assert set(json.loads(header["__metadata__"].pop(HEADER_KEY))) == {POINT}
        before = with_header(header, body)
        got[entry["file"]] = entry["sha256"] = hashlib.sha256(before).hexdigest()
        entry["bytes"] = len(before)
    raw["bytes"] = sum(entry["bytes"] for entry in raw["shards"])
    got["manifest.json"] = hashlib.sha256(Manifest._from_json(raw).to_bytes()).hexdigest()
    assert got == WRITTEN_BY_B05E947


def test_open_verify_and_read_rows(store, location):
    verified = open_store(location, verify=True)
    assert len(verified) == ROWS and verified.num_shards == len(store.manifest.shards) >= 4
    for name, want in REF.items():
        assert torch.equal(store.tensor(name), want), name
    for start, stop in ((0, ROWS), (5, 23), (ROWS - 3, ROWS)):
        got = store.rows(start, stop)
        assert all(torch.equal(got[k], REF[k][start:stop]) for k in REF)
    for row in (0, 17, -1):
        assert torch.equal(store[row][POINT], REF[POINT][row])
    assert torch.equal(torch.as_tensor(store.to_numpy(POINT)), REF[POINT].float())


def test_verify_names_a_damaged_shard(store, location):
    fs, rel = open_fs(location), store.manifest.shards[1].file
    data = bytearray(fs.read(rel))
    data[-1] ^= 0xFF  # the same size, another byte: only the checksum tells
    fs.put(rel, bytes(data))
    with pytest.raises(StoreError, match=r"shard-r000-000001.*checksum \(xxh3_128\) differs"):
        open_store(location, verify=True)


def test_the_dataset_yields_every_row_once(store):
    seen = {}
    for b in store.dataset([POINT, "token_ids"], seed=3, buffer_rows=12, batch_size=5):
        for x, t in zip(b[POINT], b["token_ids"].tolist(), strict=True):
            assert t not in seen
            seen[t] = x
    assert sorted(seen) == REF["token_ids"].tolist()
    assert all(torch.equal(seen[t], REF[POINT][t]) for t in seen)


def test_both_exports_hold_the_rows_written(store, tmp_path):
    import datasets  # the test extra has it: every environment that runs this file installs it

    from hookscope.export import export_hf, export_saelens

    export_hf(store, tmp_path / "hf", progress=False)
    hf = datasets.load_from_disk(str(tmp_path / "hf"))
    assert hf["token_ids"] == REF["token_ids"].tolist()
    assert torch.equal(torch.tensor(hf[POINT], dtype=torch.float16), REF[POINT])
    done = export_saelens(store, tmp_path / "sae", context_size=4, progress=False)
    sae = datasets.load_from_disk(str(tmp_path / "sae"))
    whole = ROWS // 4 * 4
    assert done.examples == ROWS // 4 and done.hook_name == "blocks.0.hook_resid_post"
    assert torch.equal(
        torch.tensor(sae[done.hook_name], dtype=torch.float16).reshape(-1, UNITS), REF[POINT][:whole]
    )
    assert torch.tensor(sae["token_ids"]).reshape(-1).tolist() == REF["token_ids"][:whole].tolist()


def top_rows(unit: int, k: int) -> list[int]:
    """The k rows where `unit` is largest, from the rows written."""
    return torch.argsort(REF[POINT][:, unit].float(), descending=True)[:k].tolist()


def around(row: int, context: int) -> list[int]:
    """The token ids of the rows within `context` of `row` in its own sequence and document."""
    same = [
        r
        for r in range(row - context, row + context + 1)
        if 0 <= r < ROWS
        and REF["seq_ids"][r] == REF["seq_ids"][row]
        and REF["doc_ids"][r] == REF["doc_ids"][row]
    ]
    return REF["token_ids"][same].tolist()


def test_top_keeps_its_index_beside_the_store(store, location, tmp_path, monkeypatch):
    monkeypatch.setenv("HOOKSCOPE_CACHE", str(tmp_path / "cache"))
    result = hs.top(store, POINT, 2, k=3, context=1)
    assert result.rows.tolist() == top_rows(2, 3)
    assert result.values.tolist() == REF[POINT][top_rows(2, 3), 2].float().tolist()
    assert [c.token_ids for c in result.contexts] == [around(r, 1) for r in top_rows(2, 3)]
    fs = open_fs(location)
    assert fs.list("top") == [f"{POINT}.neurons.safetensors"]
    assert not (tmp_path / "cache").exists()
    again = hs.top(open_store(location), POINT, 5, k=2)  # the saved index: every unit is in it
    assert again.rows.tolist() == top_rows(5, 2)


def test_top_goes_to_the_cache_when_the_store_cannot_be_written(store, location, tmp_path, monkeypatch):
    monkeypatch.setenv("HOOKSCOPE_CACHE", str(tmp_path / "cache"))

    def read_only(*args, **kwargs):
        raise PermissionError("read-only")

    monkeypatch.setattr(store.fs, "put", read_only)
    assert hs.top(store, POINT, 1, k=4).rows.tolist() == top_rows(1, 4)
    cached = list((tmp_path / "cache" / "top").rglob("*.safetensors"))
    assert [p.name for p in cached] == [f"{POINT}.neurons.safetensors"]
    assert open_fs(location).list("top") == []
    # a new opening, writable again: the cached index serves it, and nothing is rebuilt beside it
    assert hs.top(open_store(location), POINT, 4, k=4).rows.tolist() == top_rows(4, 4)
    assert open_fs(location).list("top") == []
    # a stated cache directory: the index goes there, never beside the store
    assert hs.top(store, POINT, 0, k=2, cache_dir=tmp_path / "mine").rows.tolist() == top_rows(0, 2)
    assert len(list((tmp_path / "mine").rglob("*.safetensors"))) == 1


def test_inspect_reports_and_verifies(store, location, capsys):
    from hookscope.cli import main

    assert main(["inspect", location]) == 0
    out = capsys.readouterr().out
    assert f"{ROWS:,} rows in {store.num_shards} shards" in out
    assert f"{POINT}: [{UNITS}] float16" in out
    assert f"verified: {store.num_shards} shards" in out


def test_the_per_dimension_stats_come_from_every_shard_header(store):
    """Merged from the headers, read through the store's filesystem (ranged reads at a URL): the
    float64 mean and variance of the rows this test wrote."""
    x = REF[POINT].double()
    st = store.stats[POINT]
    var = x.var(0, correction=0)
    assert float(((st.mean - x.mean(0)).abs() / var.sqrt()).max()) < 1e-6  # float32 sums per batch
    assert torch.allclose(st.var, var, rtol=1e-5, atol=0)


@pytest.mark.slow
def test_an_interrupted_store_resumes_to_the_rows_written(location, tmp_path):
    write(location, range(5), interrupt=True)  # Ctrl-C after batch 4: the unfinished shard is dropped
    partial = open_store(location)
    assert 0 < len(partial) < sum(4 + j % 3 for j in range(5))
    assert torch.equal(partial.tensor(POINT), REF[POINT][: len(partial)])
    reopened = ShardWriter(location, SETTINGS, shard_rows=SHARD_ROWS)
    done = set(reopened.done_batches)
    reopened.close()
    assert done == set(range(max(done) + 1)) and max(done) < 4
    write(location)  # the same command again: it resumes
    resumed = open_store(location, verify=True)
    assert all(torch.equal(resumed.tensor(k), REF[k]) for k in REF)
    # shard for shard the bytes of a store written in one go on the local disk
    write(str(tmp_path / "one-go"))
    assert [(s.file, s.checksum) for s in resumed.manifest.shards] == [
        (s.file, s.checksum) for s in open_store(tmp_path / "one-go").manifest.shards
    ]
