"""The filesystem seam without a server: a store at memory:// (fsspec's in-process filesystem) and
at file:// holds exactly the bytes of the local store, reads back the same, and refuses what the
local reader refuses. The S3 server tests are in test_store_s3.py."""

from __future__ import annotations

import hashlib
from pathlib import Path

import fsspec
import pytest
import torch

from hookscope.errors import StoreError
from hookscope.store import ShardWriter, merge_rank_manifests, open_store


def write(out: str, world_size: int = 1) -> None:
    gen = torch.Generator().manual_seed(0)
    writers = [
        ShardWriter(out, {"test": "url"}, shard_rows=10, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    for i in range(12):
        rows = 3 + i % 4
        writers[i % world_size].write(
            i,
            {"p": torch.randn(rows, 5, generator=gen).to(torch.bfloat16)},
            {"token_ids": torch.arange(rows) + 100 * i},
        )
    for w in writers:
        w.close()
    if world_size > 1:
        merge_rank_manifests(out, world_size)


def local_files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def memory_files(url: str) -> dict[str, str]:
    fs = fsspec.filesystem("memory")
    root = url.removeprefix("memory://")
    prefix = root.lstrip("/") + "/"
    return {
        p.removeprefix("/").removeprefix(prefix): hashlib.sha256(fs.cat_file(p)).hexdigest()
        for p in fs.find(root)
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_memory_url_holds_the_local_bytes(tmp_path, world_size):
    url = f"memory://stores/w{world_size}"
    write(str(tmp_path / "local"), world_size)
    write(url, world_size)
    assert memory_files(url) == local_files(tmp_path / "local")
    remote, local = open_store(url, verify=True), open_store(tmp_path / "local")
    assert remote.num_shards == local.num_shards > 2
    for name in ("p", "token_ids"):
        assert torch.equal(remote.tensor(name), local.tensor(name))
    rows = list(remote.dataset("p", seed=1, buffer_rows=7))
    assert len(rows) == len(local) and all(
        torch.equal(a, b) for a, b in zip(rows, local.dataset("p", seed=1, buffer_rows=7), strict=True)
    )


def test_file_url_is_the_local_path(tmp_path):
    write(f"file://{tmp_path / 'store'}")
    assert len(open_store(tmp_path / "store", verify=True)) == len(open_store(f"file://{tmp_path / 'store'}"))


def test_memory_url_refuses_damage_and_unknown_schemes():
    url = "memory://stores/damaged"
    write(url)
    fs = fsspec.filesystem("memory")
    shard = "/stores/damaged/shards/shard-r000-000001.safetensors"
    fs.pipe_file(shard, fs.cat_file(shard)[:-7])
    with pytest.raises(StoreError, match="shard-r000-000001"):
        open_store(url, verify=True)
    with pytest.raises(StoreError, match="no such store"):
        open_store("memory://stores/nothing-here")
    with pytest.raises(StoreError, match="nosuchscheme"):
        open_store("nosuchscheme://bucket/store")
