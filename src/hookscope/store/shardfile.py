"""One shard file written in one pass over its bytes: the bytes `safetensors.torch.save_file` would
write (the header, then each tensor's data), taken straight from the tensors' memory (a column
given as several batches is written batch after batch: no concatenated copy), checksummed while
they are written (by a pool's threads, each piece at its offset, or around the page cache through
direct.py's buffers), and fsynced. tests/store/test_store_shardfile.py holds it byte for byte to save_file.

Only the dtypes safetensors names are written here; `writable` says whether a set of columns is.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import struct
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor, wait
from pathlib import Path

import torch

from .checksum import checksum_of, hasher
from .direct import Bounce, open_for_writing, write_at

# safetensors' name of each dtype, and its rank in safetensors' own order of dtypes: a file holds
# its tensors by descending rank, then by name (safetensors' `prepare`)
DTYPES: dict[torch.dtype, tuple[str, int]] = {
    torch.bool: ("BOOL", 0),
    torch.uint8: ("U8", 1),
    torch.int8: ("I8", 2),
    torch.float8_e5m2: ("F8_E5M2", 3),
    torch.float8_e4m3fn: ("F8_E4M3", 4),
    torch.int16: ("I16", 5),
    torch.uint16: ("U16", 6),
    torch.float16: ("F16", 7),
    torch.bfloat16: ("BF16", 8),
    torch.int32: ("I32", 9),
    torch.uint32: ("U32", 10),
    torch.float32: ("F32", 11),
    torch.complex64: ("C64", 12),
    torch.float64: ("F64", 13),
    torch.int64: ("I64", 14),
    torch.uint64: ("U64", 15),
}
PIECE = 8 * 2**20  # bytes one thread writes at a time: a few per shard per thread, each hashed in cache

Columns = Mapping[str, Sequence[torch.Tensor]]  # name -> the parts (batches) of one column, in row order


def writable(columns: Columns) -> bool:
    """Whether every part is a contiguous CPU tensor of a dtype this module writes."""
    return all(
        p.dtype in DTYPES and p.device.type == "cpu" and p.is_contiguous()
        for parts in columns.values()
        for p in parts
    ) and all(len({(p.dtype, tuple(p.shape[1:])) for p in parts}) == 1 for parts in columns.values())


def header(columns: Columns, metadata: Mapping[str, str] | None) -> tuple[bytes, list[str]]:
    """The header bytes (8-byte length, JSON padded with spaces to 8 bytes) and the columns' order."""
    order = sorted(columns, key=lambda n: (-DTYPES[columns[n][0].dtype][1], n))
    entries: dict[str, object] = {}
    if metadata is not None:
        entries["__metadata__"] = dict(metadata)
    start = 0
    for name in order:
        parts = columns[name]
        rows = sum(p.shape[0] for p in parts) if parts[0].dim() else None
        shape = list(parts[0].shape) if rows is None else [rows, *parts[0].shape[1:]]
        size = sum(p.nbytes for p in parts)
        entries[name] = {
            "dtype": DTYPES[parts[0].dtype][0],
            "shape": shape,
            "data_offsets": [start, start + size],
        }
        start += size
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


def save_columns(
    columns: Columns,
    path: Path,
    metadata: Mapping[str, str] | None,
    algorithm: str,
    pool: Executor | None = None,
    mode: int = 0o666,
    sync: bool = True,
    bounce: Bounce | None = None,
) -> tuple[int, str]:
    """`write_shard_file`, or for a column it cannot write (a dtype it does not name, a tensor
    elsewhere than the CPU) safetensors' own save_file, fsynced, then checksummed read back.
    `sync=False`: not fsynced here (the caller calls `sync_file` before the file counts)."""
    if writable(columns):
        return write_shard_file(columns, path, metadata, algorithm, pool, mode, sync, bounce)
    from safetensors.torch import save_file

    save_file(
        {k: torch.cat(list(v)) if len(v) > 1 else v[0] for k, v in columns.items()},
        path,
        metadata=None if metadata is None else dict(metadata),
    )
    os.chmod(path, mode)
    with open(path, "rb") as f:
        os.fsync(f.fileno())  # raises the fsync's error (a full disk): the shard is not durable
        return checksum_of(f, algorithm)


def write_shard_file(
    columns: Columns,
    path: Path,
    metadata: Mapping[str, str] | None,
    algorithm: str,
    pool: Executor | None = None,
    mode: int = 0o666,
    sync: bool = True,
    bounce: Bounce | None = None,
) -> tuple[int, str]:
    """Write `columns` to `path` as a safetensors file, fsynced unless `sync` is False; (bytes, hex
    checksum by `algorithm`). `bounce`: around the page cache, through its buffer (direct.py)."""
    head, order = header(columns, metadata)
    pieces = [memoryview(head)]
    for name in order:
        for part in columns[name]:
            data = memoryview(part.reshape(-1).view(torch.uint8).numpy())
            pieces += [data[i : i + PIECE] for i in range(0, len(data), PIECE)]
    h = hasher(algorithm)
    fd, direct = open_for_writing(path, mode, direct=bounce is not None)
    try:
        if bounce is not None and direct:  # one job: the pieces through the buffers, in order
            jobs = [functools.partial(bounce.write, fd, pieces)]
        else:  # each piece at its offset
            offsets = itertools.accumulate((len(p) for p in pieces[:-1]), initial=0)
            jobs = [functools.partial(write_at, fd, p, at) for p, at in zip(pieces, offsets, strict=True)]
        done = [] if pool is None else [pool.submit(job) for job in jobs]
        try:
            if pool is None:
                for job in jobs:
                    job()
            for piece in pieces:  # the pool writes, this thread checksums the same bytes meanwhile
                h.update(piece)
        finally:
            wait(done)  # every write has ended before the descriptor closes (or is reused)
        for d in done:
            d.result()  # the first write error (a full disk), raised here
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return sum(len(p) for p in pieces), h.hexdigest()


def shared_mode() -> int:
    """The mode a shard file gets: the umask's, as for any file (safetensors creates 0600 files; a
    store is meant to be shared). Call it on the main thread: reading the umask means setting it."""
    mask = os.umask(0)
    os.umask(mask)  # straight back
    return 0o666 & ~mask


def default_copiers() -> int:
    """Copy threads per shard writer: one. A local filesystem (ext4, xfs, tmpfs) takes a file's
    buffered writes one at a time (the inode's lock), so a second thread on the same shard only
    spins waiting for the first: it cost more CPU for the copy and ran no faster (bench/HISTORY.md,
    Writer, "One copy thread a shard"). `ShardWriter(writers=)` asks for more
    where a filesystem takes parallel writes to one file."""
    return 1


def sync_file(path: Path) -> None:
    """fsync `path`'s data (written earlier, through another descriptor): raises the disk's error."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
