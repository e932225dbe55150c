"""Reading a store at a URL with ranged GETs: a shard's header with one small GET (batched with the
next shards' headers), checked like a local one (store/checks.py), then only the byte ranges of the
columns and rows asked for, through a bounded in-memory block cache (store/range_cache.py), reading the
next shards ahead on a sequential scan."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor

import torch

from ..errors import StoreError
from .checks import HEAD_BYTES, Header, check_size, checked_header, tensor_of
from .fs import FS, Part
from .manifest import Manifest
from .range_cache import BlockCache, Extent
from .stats import stats_header_bytes

_HEADER_BATCH = 16  # a header is fetched with those of the next shards not known yet: one round trip
_READ_AHEAD = 2  # shards whose columns a sequential scan fetches ahead


class RangedShards:
    """The shards of a remote store, read by byte range. `sizes` are the objects' sizes as listed
    when the store was opened."""

    def __init__(self, fs: FS, manifest: Manifest, sizes: dict[str, int]):
        self.fs = fs
        self.manifest = manifest
        self.blocks = BlockCache(fs, sizes)
        self._headers: dict[int, Header] = {}  # shard -> its checked header
        self._heads: dict[int, bytes] = {}  # shard -> first bytes, fetched with another's, unchecked
        self._header_lock = threading.Lock()
        self._fetching = threading.Lock()
        self._last_scanned = -1  # the last shard read whole: a sequential scan reads ahead
        self.ahead: dict[int, Future] = {}  # shard -> its readahead, header and columns
        self._pool = ThreadPoolExecutor(_READ_AHEAD, thread_name_prefix="hookscope-readahead")
        weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)

    def load(self, i: int, names: list[str]) -> dict[str, torch.Tensor]:
        """Every row of columns `names` of shard `i`."""
        ahead = self.ahead.pop(i, None)
        if ahead is not None:  # being read ahead: let it finish (its errors are raised below, by this read)
            with contextlib.suppress(CancelledError):
                ahead.exception()
        if i in (0, self._last_scanned + 1):  # a sequential scan: read the next shards ahead
            self.header(i)  # first: its batch brings the next shards' headers too
            for j in range(i + 1, min(i + 1 + _READ_AHEAD, len(self.manifest.shards))):
                self._read_ahead(j, names)
        self._last_scanned = i
        return self.rows(i, names, 0, self.manifest.shards[i].rows)

    def read_ahead(self, shards: Sequence[int], names: list[str]) -> None:
        """Start fetching columns `names` of `shards` into the block cache in the background."""
        row = sum(self.manifest.columns[n].row_bytes for n in names)
        if sum(self.manifest.shards[i].rows for i in shards) * row > self.blocks.max_bytes // 2:
            return  # they would push each other out of the cache before being read
        for i in shards:
            self._read_ahead(i, names)

    def rows(self, i: int, names: list[str], lo: int, hi: int) -> dict[str, torch.Tensor]:
        """Rows [lo, hi) of columns `names` of shard `i`: one byte range per column."""
        datas = self.blocks.read_many(self.manifest.shards[i].file, self._column_ranges(i, names, lo, hi))
        return {
            name: tensor_of(data, self.manifest.columns[name], hi - lo)
            for name, data in zip(names, datas, strict=True)
        }

    def header(self, i: int, fresh: bool = False) -> Header:
        """Shard `i`'s checked header: one small ranged GET (`fresh`: as the object is now)."""
        with self._header_lock:
            if fresh:
                self._headers.pop(i, None)
                self._heads.pop(i, None)
            if i in self._headers:
                return self._headers[i]
        entry = self.manifest.shards[i]
        where = self.fs.where(entry.file)
        size = check_size(where, self.blocks.sizes.get(entry.file), entry)
        with self._fetching:  # one batch of heads at a time: threads reading ahead would ask twice
            with self._header_lock:
                if i in self._headers:
                    return self._headers[i]
                head = self._heads.pop(i, None)
            if head is None:
                head = self._fetch_heads(i)
        header = checked_header(
            where,
            head,
            size,
            entry,
            self.manifest.settings_hash,
            self.manifest.columns,
            lambda start, end: self.fs.read_ranges(entry.file, [(start, end)])[0],
        )
        with self._header_lock:
            self._headers[i] = header
        return header

    def _column_ranges(self, i: int, names: list[str], lo: int, hi: int) -> list[tuple[Extent, int, int]]:
        """(the column's extent in the object, start, end) of rows [lo, hi) of each column."""
        data_start, header = self.header(i)
        ranges = []
        for name in names:
            begin, end = (data_start + o for o in header[name]["data_offsets"])
            row = self.manifest.columns[name].row_bytes
            ranges.append((Extent(begin, end), begin + lo * row, begin + hi * row))
        return ranges

    def _read_ahead(self, i: int, names: list[str]) -> None:
        """Fetch shard `i`'s header and columns `names` into the block cache in the background. A
        damaged shard is reported when it is read, not here."""
        rows = self.manifest.shards[i].rows
        if (
            rows * sum(self.manifest.columns[n].row_bytes for n in names) * _READ_AHEAD
            > self.blocks.max_bytes // 2
        ):  # it would push out what it was fetched for
            return
        if i not in self.ahead:
            self.ahead[i] = self._pool.submit(self._fetch_ahead, i, names)

    def _fetch_ahead(self, i: int, names: list[str]) -> None:
        ranges = self._column_ranges(i, names, 0, self.manifest.shards[i].rows)
        self.blocks.read_many(self.manifest.shards[i].file, ranges)

    def _fetch_heads(self, i: int) -> bytes:
        """Shard `i`'s first bytes (its header, unchecked). The next shards whose headers are not
        known yet, and whose listed size is right, come in the same concurrent batch: a scan,
        sequential or shuffled, waits one round trip per batch of headers, not per shard."""
        shards, sizes = self.manifest.shards, self.blocks.sizes
        batch = [i] + [
            j
            for j in range(i + 1, min(i + _HEADER_BATCH, len(shards)))
            if j not in self._headers
            and j not in self._heads
            and sizes.get(shards[j].file) == shards[j].bytes
        ][: _HEADER_BATCH - 1]
        first = HEAD_BYTES + stats_header_bytes(self.manifest.points)  # the statistics too: one GET
        heads = [Part(shards[j].file, 0, min(sizes[shards[j].file], first)) for j in batch]
        datas = self.fs.read_parts(heads)
        with self._header_lock:
            for j, data in zip(batch[1:], datas[1:], strict=True):
                if isinstance(data, bytes):
                    self._heads[j] = data
            while len(self._heads) > 4 * _HEADER_BATCH:  # heads of shards never read: keep a few
                self._heads.pop(next(iter(self._heads)))
        if isinstance(datas[0], StoreError):
            raise datas[0]
        return datas[0]
