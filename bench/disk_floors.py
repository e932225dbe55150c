"""The floors of a store's writes: the same bytes written by the simplest code, in the same directory.

- `raw_write_s`: through the page cache, into files of a shard's size, each fsynced before the next
  (what a plain `open().write()` and `fsync` get).
- `direct_write_s`: around the page cache (O_DIRECT, 8 MiB aligned writes), each file fsynced: the
  disk's own rate, where the filesystem takes O_DIRECT (None where it does not: tmpfs before Linux
  6.6, network filesystems). Written here, not with hookscope's own code, so that it is a floor.
"""

from __future__ import annotations

import errno
import mmap
import os
import time
from pathlib import Path

DIRECT_BLOCK = 8 << 20


def raw_write_s(folder: Path, chunks: list[memoryview], file_bytes: int) -> float:
    """Seconds to write `chunks` into files of `file_bytes` each in `folder`, each file fsynced."""
    start = time.perf_counter()
    f, written, n = None, 0, 0
    for chunk in chunks:
        if f is None:
            f = open(folder / f"raw-{n:04d}.bin", "wb")
        f.write(chunk)
        written += chunk.nbytes
        if written >= file_bytes:
            f.flush()
            os.fsync(f.fileno())
            f.close()
            f, written, n = None, 0, n + 1
    if f is not None:
        f.flush()
        os.fsync(f.fileno())
        f.close()
    seconds = time.perf_counter() - start
    for p in folder.glob("raw-*.bin"):
        p.unlink()
    return seconds


def raw_parts(total: int, file_bytes: int) -> list[memoryview]:
    """`total` bytes as parts of one 64 MB buffer that end where each `file_bytes` file ends (what
    `raw_write_s` writes as a store of that many bytes in shards of that size)."""
    import numpy as np

    chunk = memoryview(np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes())
    parts, left = [], total
    while left > 0:
        in_file = min(file_bytes, left)
        for at in range(0, in_file, len(chunk)):
            parts.append(chunk[: min(len(chunk), in_file - at)])
        left -= in_file
    return parts


def direct_write_s(folder: Path, total: int, file_bytes: int) -> float | None:
    """Seconds to write `total` bytes with O_DIRECT into files of `file_bytes` (rounded up to 4 KiB)
    in `folder`, each fsynced; None where the filesystem refuses O_DIRECT."""
    if not hasattr(os, "O_DIRECT"):
        return None
    block = mmap.mmap(-1, DIRECT_BLOCK)
    block.write(os.urandom(1 << 20) * (DIRECT_BLOCK >> 20))
    file_bytes = -(-file_bytes // 4096) * 4096
    start, left, n = time.perf_counter(), total, 0
    try:
        while left > 0:
            try:
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT
                fd = os.open(folder / f"direct-{n:04d}.bin", flags)
            except OSError as e:
                if e.errno == errno.EINVAL:
                    return None
                raise
            try:
                in_file = min(file_bytes, -(-left // 4096) * 4096)
                for at in range(0, in_file, DIRECT_BLOCK):
                    os.pwrite(fd, memoryview(block)[: min(DIRECT_BLOCK, in_file - at)], at)
                os.fsync(fd)
            finally:
                os.close(fd)
            left, n = left - in_file, n + 1
        return time.perf_counter() - start
    finally:
        for p in folder.glob("direct-*.bin"):
            p.unlink()
