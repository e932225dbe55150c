"""Shards written around the page cache (store/direct.py): the same bytes safetensors' save_file
writes, whatever their size against the buffer and O_DIRECT's blocks; written with O_DIRECT where
the filesystem is a disk's (the flag seen on the descriptor at each write); the same bytes through
the page cache where a filesystem refuses it, at the open or at a write; and which directories are
written directly, read from the kernel's own table of mounts."""

from __future__ import annotations

import errno
import fcntl
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import save_file

from hookscope.store import direct, open_store
from hookscope.store.shardfile import write_shard_file
from hookscope.store.writer import ShardWriter

SMALL_BLOCK = 16 * 4096  # a few of O_DIRECT's blocks: a shard of a few hundred KB spans several buffers


def on_a_disk(path: Path) -> bool:
    return direct.filesystem_of(path) in direct.BLOCK_FILESYSTEMS or direct.filesystem_of(path) == "overlay"


def shard(rows: int, width: int = 300) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, width, generator=g).to(torch.bfloat16)
    cut = rows // 3
    return {"p": [x[:cut], x[cut:]], "token_ids": [torch.arange(cut), torch.arange(cut, rows)]}


def reference(columns, tmp_path: Path, metadata) -> bytes:
    save_file({k: torch.cat(v) for k, v in columns.items()}, tmp_path / "ref.safetensors", metadata=metadata)
    return (tmp_path / "ref.safetensors").read_bytes()


def written_with_flags(monkeypatch) -> list[tuple[int, bool]]:
    """(bytes, whether O_DIRECT was on) of every write the bounce path makes."""
    seen, real = [], os.pwrite

    def pwrite(fd, data, offset):
        seen.append((len(data), bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)))
        return real(fd, data, offset)

    monkeypatch.setattr(direct.os, "pwrite", pwrite)
    return seen


# rows x (300 bf16 + an int64) = 608 bytes a row: 3 rows are under one block, 7 rows fill none
# exactly, 431 rows span several buffers of SMALL_BLOCK with a partial block left over
@pytest.mark.parametrize("rows", [3, 7, 431, 1000])
@pytest.mark.parametrize("threads", [0, 1])
def test_direct_writes_give_the_bytes_safetensors_writes(tmp_path: Path, monkeypatch, rows, threads):
    monkeypatch.setattr(direct, "BLOCK", SMALL_BLOCK)
    columns, metadata = shard(rows), {"hookscope.shard": f"{rows} rows"}
    want = reference(columns, tmp_path, metadata)
    pool = ThreadPoolExecutor(threads) if threads else None
    size, digest = write_shard_file(
        columns, tmp_path / "s", metadata, "xxh3_128", pool, bounce=direct.Bounce()
    )
    got = (tmp_path / "s").read_bytes()
    assert got == want
    assert (size, digest) == (len(want), xxhash.xxh3_128(want).hexdigest())


def test_the_bytes_go_around_the_page_cache_on_a_disk(tmp_path: Path, monkeypatch):
    if not on_a_disk(tmp_path):
        pytest.skip(f"{tmp_path} is on {direct.filesystem_of(tmp_path)}, not a disk's filesystem")
    monkeypatch.setattr(direct, "BLOCK", SMALL_BLOCK)
    seen = written_with_flags(monkeypatch)
    columns = shard(1000)
    size, _ = write_shard_file(columns, tmp_path / "s", None, "xxh3_128", bounce=direct.Bounce())
    assert (tmp_path / "s").read_bytes() == reference(columns, tmp_path, None)
    whole, tail = divmod(size, SMALL_BLOCK)
    # every full buffer directly, then the last buffer's whole blocks directly, its rest through the cache
    assert [d for _, d in seen] == [True] * (whole + 1) + [False]
    assert [n for n, _ in seen] == [SMALL_BLOCK] * whole + [tail - tail % 4096, tail % 4096]


def test_a_filesystem_refusing_o_direct_at_the_open_gets_the_same_bytes(tmp_path: Path, monkeypatch):
    real = os.open

    def refusing(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *args)

    monkeypatch.setattr(direct.os, "open", refusing)
    seen = written_with_flags(monkeypatch)
    columns = shard(431)
    write_shard_file(columns, tmp_path / "s", None, "sha256", bounce=direct.Bounce())
    assert (tmp_path / "s").read_bytes() == reference(columns, tmp_path, None)
    assert seen and not any(d for _, d in seen)  # every write through the page cache


def test_a_filesystem_refusing_a_direct_write_gets_the_rest_through_the_cache(tmp_path: Path, monkeypatch):
    if not on_a_disk(tmp_path):
        pytest.skip(f"{tmp_path} is on {direct.filesystem_of(tmp_path)}, not a disk's filesystem")
    monkeypatch.setattr(direct, "BLOCK", SMALL_BLOCK)
    real, refused = os.pwrite, []

    def refusing(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and offset >= SMALL_BLOCK:  # the second buffer
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(direct.os, "pwrite", refusing)
    columns = shard(1000)
    write_shard_file(columns, tmp_path / "s", {"k": "v"}, "xxh3_128", bounce=direct.Bounce())
    assert refused == [SMALL_BLOCK]  # refused once; the rest went through the page cache
    assert (tmp_path / "s").read_bytes() == reference(columns, tmp_path, {"k": "v"})


def test_another_write_error_is_raised(tmp_path: Path, monkeypatch):
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct.os, "pwrite", full)
    with pytest.raises(OSError) as e:
        direct.Bounce().write(os.open(tmp_path / "s", os.O_WRONLY | os.O_CREAT), [memoryview(b"x" * 5000)])
    assert e.value.errno == errno.ENOSPC


MOUNTINFO = """\
22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda rw
25 22 0:21 / /dev/shm rw,nosuid shared:3 - tmpfs tmpfs rw
31 22 0:30 / /data/my\\040runs rw,relatime shared:9 - xfs /dev/nvme0n1 rw
32 31 0:31 / /data/my\\040runs/fuse rw - fuse.s3fs s3fs rw
33 22 0:32 / /mnt/nfs rw - nfs4 server:/export rw
"""


@pytest.mark.parametrize(
    "path, kind",
    [
        ("/home/me/store", "ext4"),
        ("/dev/shm/store", "tmpfs"),
        ("/data/my runs/store", "xfs"),
        ("/data/my runs/fuse/store", "fuse.s3fs"),
        ("/mnt/nfs", "nfs4"),
        ("/dev/shmem", "ext4"),
    ],
)
def test_the_filesystem_is_that_of_the_longest_mount_above(path: str, kind: str):
    assert direct.filesystem_of(Path(path), MOUNTINFO) == kind


# a container's view: its root an overlay whose upper layer is the host's (not a path it can see),
# a volume on xfs, an overlay of its own over that volume, one over tmpfs, a read-only one
CONTAINER = """\
40 1 0:40 / / rw - overlay overlay rw,lowerdir=/var/lib/docker/l/A,upperdir=/var/lib/docker/abc/diff
41 40 0:21 / /dev/shm rw - tmpfs shm rw,size=65536k
42 40 259:1 /vol /data rw,relatime - xfs /dev/nvme0n1p1 rw
43 40 0:43 / /stacked rw - overlay overlay rw,lowerdir=/data/low,upperdir=/data/up,workdir=/data/work
44 40 0:44 / /scratch rw - overlay overlay rw,lowerdir=/data/low,upperdir=/dev/shm/up,workdir=/dev/shm/work
45 40 0:45 / /ro ro - overlay overlay ro,lowerdir=/data/low:/data/low2
46 40 0:46 / /over,comma rw - overlay overlay rw,lowerdir=/data/low,upperdir=/fast\\054tmp/up
47 40 0:47 / /fast,tmp rw - tmpfs tmpfs rw
"""


@pytest.mark.parametrize(
    "path, disk",
    [
        (
            "/root/store",
            True,
        ),  # the container's own filesystem: its upper layer out of sight, on the host's disk
        ("/data/store", True),
        ("/stacked/store", True),  # xfs, and an overlay whose upper layer is on it
        ("/dev/shm/store", False),
        ("/scratch/store", False),  # tmpfs, and an overlay whose upper layer is on it
        ("/ro/store", False),  # no upper layer: nothing is written there
        ("/over,comma/store", False),  # an upper layer on tmpfs, its path with an escaped comma
    ],
)
def test_an_overlay_is_written_directly_where_its_upper_layer_is_on_a_disk(path: str, disk: bool):
    assert direct.on_a_disk(Path(path), CONTAINER) is disk
    assert direct.on_a_disk(Path(path), MOUNTINFO.replace("ext4", "tmpfs")) is False  # no overlay: tmpfs


def test_a_store_on_an_overlay_mounted_here_is_written_directly(tmp_path: Path, monkeypatch):
    import gc
    import subprocess

    if not on_a_disk(tmp_path) or direct.filesystem_of(tmp_path) == "overlay" or os.geteuid() != 0:
        pytest.skip("needs root, to mount an overlay over a disk's filesystem")
    layers = {name: tmp_path / name for name in ("lower", "upper", "work", "merged")}
    for d in layers.values():
        d.mkdir()
    options = "lowerdir={lower},upperdir={upper},workdir={work}".format(**layers)
    if (
        subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", options, str(layers["merged"])], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("this machine does not let us mount an overlay")
    try:
        assert direct.filesystem_of(layers["merged"]) == "overlay" and direct.wanted(layers["merged"])
        seen = written_with_flags(monkeypatch)
        x = torch.randn(3000, 64).to(torch.bfloat16)
        with ShardWriter(layers["merged"] / "store", {"t": 1}, shard_rows=2000) as w:
            w.write(0, {"p": x[:2000]}, {"token_ids": torch.arange(2000)})
            w.write(1, {"p": x[2000:]}, {"token_ids": torch.arange(2000, 3000)})
        assert any(d for _, d in seen)  # through O_DIRECT, on the overlay
        store = open_store(layers["merged"] / "store")
        store.verify()
        assert torch.equal(store.tensor("p"), x)
        del store  # its files open no more: the overlay can be unmounted
        gc.collect()
    finally:
        subprocess.run(["umount", "--lazy", str(layers["merged"])], check=True)


def test_which_directories_are_written_directly(tmp_path: Path, monkeypatch):
    assert direct.wanted(tmp_path) == on_a_disk(tmp_path)
    if Path("/dev/shm").is_dir():
        assert direct.filesystem_of(Path("/dev/shm")) == "tmpfs" and not direct.wanted(Path("/dev/shm"))
    monkeypatch.setenv(direct.ENV, "0")
    assert not direct.wanted(tmp_path)


def test_a_store_on_a_disk_is_written_directly_and_reads_back(tmp_path: Path, monkeypatch):
    if not on_a_disk(tmp_path):
        pytest.skip(f"{tmp_path} is on {direct.filesystem_of(tmp_path)}, not a disk's filesystem")
    seen = written_with_flags(monkeypatch)
    x = torch.randn(5000, 64).to(torch.bfloat16)
    with ShardWriter(tmp_path / "store", {"t": 1}, shard_rows=2000) as w:
        for i in range(5):
            rows = slice(i * 1000, (i + 1) * 1000)
            w.write(i, {"p": x[rows]}, {"token_ids": torch.arange(5000)[rows]})
    assert any(d for _, d in seen)  # through O_DIRECT
    store = open_store(tmp_path / "store")
    store.verify()  # every shard's checksum against its bytes on disk
    assert store.num_shards == 3 and torch.equal(store.tensor("p"), x)
    assert torch.equal(store.tensor("token_ids"), torch.arange(5000))
