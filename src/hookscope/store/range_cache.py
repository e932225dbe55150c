"""A bounded in-memory cache of byte ranges of a store's objects, read with ranged GETs (a store at
a URL: see store/fs.py)."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, NamedTuple

from ..errors import StoreError

if TYPE_CHECKING:
    from .fs import FS


def _env_bytes(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise StoreError(f"${name}={text!r}: give a number of bytes, e.g. {default}") from None


class Extent(NamedTuple):
    """Bytes [start, end) of one tensor in an object: its blocks are cut from its start."""

    start: int
    end: int


class BlockKey(NamedTuple):
    """One cached block: the `block`-th block of `extent` in object `rel`."""

    rel: str
    extent: Extent
    block: int


class BlockCache:
    """Byte ranges of a store's objects, read with ranged GETs and kept in memory in blocks
    (bounded by bytes, least recently used evicted; thread-safe).

    Blocks are cut from the start of the extent a range lies in (one column of one shard), so a
    whole column is fetched exactly, and a window of rows costs at most two part-blocks more than
    its own bytes; the rest of the block around a row is its readahead. A read fetches the blocks
    it touches that are not held in one concurrent batch (one GET per block; s3fs, gcsfs and adlfs
    send them at once). Every GET must return exactly the bytes asked for: a short answer means the
    object is shorter than listed (truncated or replaced), an error naming the object."""

    def __init__(
        self, fs: FS, sizes: dict[str, int], *, block_bytes: int | None = None, max_bytes: int | None = None
    ):
        self.fs = fs
        self.sizes = sizes  # rel -> object size, as listed when the store was opened
        # 8 MiB: the size of ranged GET that object stores serve at full speed, few enough requests
        self.block = block_bytes or _env_bytes("HOOKSCOPE_BLOCK_BYTES", 8 << 20)
        self.max_bytes = max_bytes if max_bytes is not None else _env_bytes("HOOKSCOPE_CACHE_BYTES", 1 << 30)
        if self.block < 1 or self.max_bytes < 0:
            raise StoreError(f"block size ({self.block}) must be >= 1 and cache size ({self.max_bytes}) >= 0")
        self._blocks: OrderedDict[BlockKey, bytes] = OrderedDict()  # oldest first
        self._held = 0
        self._lock = threading.Lock()

    def read_many(self, rel: str, ranges: list[tuple[Extent, int, int]]) -> list[bytes]:
        """Bytes [start, end) of object `rel` for each (extent, start, end), the range inside the
        extent; the missing blocks of all of them fetched in one concurrent batch."""
        keys = []
        for extent, start, end in ranges:
            size = self.sizes.get(rel)
            if size is None or not 0 <= extent.start <= start <= end <= extent.end <= size:
                raise StoreError(
                    f"{self.fs.url}/{rel}: bytes {start}-{end} of extent {extent} asked "
                    f"for, but the object has {size} bytes"
                )
            keys.append([BlockKey(rel, extent, b) for b in self._span(extent, start, end)])
        got: dict[BlockKey, bytes] = {}
        with self._lock:
            for key in {k for ks in keys for k in ks}:
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                    got[key] = self._blocks[key]
        missing = sorted({k for ks in keys for k in ks} - got.keys())
        if missing:
            got.update(self._fetch(rel, missing))
        out = []
        for (extent, start, end), ks in zip(ranges, keys, strict=True):
            first = extent.start + ks[0].block * self.block if ks else start
            out.append(b"".join(got[k] for k in ks)[start - first : end - first])
        return out

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._held = 0

    @property
    def held(self) -> int:
        """Bytes held now."""
        return self._held

    def _span(self, extent: Extent, start: int, end: int) -> range:
        if end <= start:
            return range(0)
        return range((start - extent.start) // self.block, -(-(end - extent.start) // self.block))

    def _fetch(self, rel: str, keys: list[BlockKey]) -> dict[BlockKey, bytes]:
        ranges = []
        for key in keys:
            start = key.extent.start + key.block * self.block
            ranges.append((start, min(start + self.block, key.extent.end)))
        datas = self.fs.read_ranges(rel, ranges)
        for (start, end), data in zip(ranges, datas, strict=True):
            if len(data) != end - start:
                raise StoreError(
                    f"{self.fs.url}/{rel}: bytes {start}-{end} came back as {len(data)} "
                    f"bytes: the object is shorter than the {self.sizes[rel]} listed when the "
                    "store was opened (truncated or replaced while read); re-open the store"
                )
        got = dict(zip(keys, datas, strict=True))
        with self._lock:
            for key, data in got.items():
                if key not in self._blocks:
                    self._blocks[key] = data
                    self._held += len(data)
            while self._held > self.max_bytes and self._blocks:
                _, old = self._blocks.popitem(last=False)
                self._held -= len(old)
        return got
