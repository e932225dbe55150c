"""Shard checksums. A manifest names each shard's algorithm beside its digest: the writer uses
`xxh3_128` (xxHash's XXH3, 128 bits: faster on one core than a disk writes, so checksumming never
bounds a writer; it detects damage, not tampering); `sha256` (slower than a fast disk on one core,
too slow to write with) is in stores that earlier releases wrote. Both are read, verified and resumed
alike."""

from __future__ import annotations

import hashlib
import mmap
from typing import Any, BinaryIO

CHUNK = 4 * 2**20
ALGORITHMS = {"sha256": 64, "xxh3_128": 32}  # algorithm -> hex digest length
WRITTEN = "xxh3_128"  # what new shards carry


def hasher(algorithm: str) -> Any:
    """A fresh incremental hash object (`update(bytes-like)`, `hexdigest()`) of `algorithm`."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    raise ValueError(f"unknown checksum algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}")


def checksum_of(f: BinaryIO, algorithm: str) -> tuple[int, str]:
    """(bytes read, hex digest) of what is left in the open binary file `f`: a local file read from
    its start is hashed through a memory map (no copy into Python; the hash releases the GIL), any
    other in 4 MiB chunks (a filesystem that cannot map files, e.g. FUSE in direct-I/O mode, too)."""
    h = hasher(algorithm)
    if f.tell() == 0:
        try:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                h.update(mapped)
                size = len(mapped)
            f.seek(size)  # read to the end, as the chunked path leaves it
            return size, h.hexdigest()
        except (OSError, ValueError):  # no file descriptor, an empty file, an unmappable filesystem
            h = hasher(algorithm)
    size = 0
    while chunk := f.read(CHUNK):
        h.update(chunk)
        size += len(chunk)
    return size, h.hexdigest()
