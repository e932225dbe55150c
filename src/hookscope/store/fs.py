"""Where a store's bytes live: a local directory, or a URL on an fsspec filesystem.

A local path (or `file://`) keeps the POSIX path the writer and reader always had: write `.tmp`,
fsync, rename, fsync the directory. Any other URL (`s3://`, `gs://`, `az://`, `hf://`,
`memory://`) goes through that scheme's fsspec filesystem (`pip install 'hookscope[s3]'`, `[gcs]`,
`[azure]`, `[hf]`). Object stores have no atomic rename, so there a shard object is uploaded under
its final name first and the manifest object, written in one PUT, is the commit point: a shard
that the manifest does not list does not exist for readers, and the next writer deletes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import StoreError

CHUNK = 1 << 22  # 4 MiB reads: large enough to hash at disk speed, small enough to stay flat in memory

# the optional package behind each scheme, for the message when it is missing
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure",
           "abfss": "azure", "hf": "hf"}


def sha256_of(f: BinaryIO) -> tuple[int, str]:
    """(bytes read, hex SHA-256) of what is left in the open binary file `f`."""
    h = hashlib.sha256()
    size = 0
    while chunk := f.read(CHUNK):
        h.update(chunk)
        size += len(chunk)
    return size, h.hexdigest()


def is_remote(name: str | os.PathLike) -> bool:
    """True for a URL other than file://: the store lives on an fsspec filesystem."""
    text = os.fspath(name)
    return "://" in text and not text.startswith("file://")


def local_path(name: str | os.PathLike) -> Path:
    text = os.fspath(name)
    return Path(text.removeprefix("file://")) if text.startswith("file://") else Path(text)


class Remote:
    """A store directory on an fsspec filesystem: the few operations the writer and reader need,
    each naming the URL in its error."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        try:
            import fsspec
        except ImportError as e:  # pragma: no cover - fsspec comes with torch's own dependencies
            raise StoreError(f"{url}: URLs need the fsspec package: pip install fsspec") from e
        scheme = url.split("://", 1)[0]
        try:
            fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except ImportError as e:
            extra = _EXTRAS.get(scheme)
            hint = f"pip install 'hookscope[{extra}]'" if extra else f"install fsspec's backend for {scheme}://"
            raise StoreError(f"{url}: no filesystem for {scheme}:// is installed ({e}); {hint}") from e
        except ValueError as e:
            raise StoreError(f"{url}: not a store URL fsspec knows ({e})") from e
        self.url, self.fs, self.root = url.rstrip("/"), fs, root.rstrip("/")
        self.bytes_read = self.requests = 0  # what reads have fetched, for tests and benchmarks
        self._stats_lock = threading.Lock()

    def __str__(self) -> str:
        return self.url

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def list(self, rel: str = "") -> list[str]:
        """Names (not paths) of the objects directly under `rel`; [] if there are none."""
        try:
            found = self.fs.ls(self.path(rel), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StoreError(f"{self.url}: cannot list {rel or 'the store'} ({e})") from e
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in found)

    def read(self, rel: str) -> bytes:
        try:
            data = self.fs.cat_file(self.path(rel))
        except FileNotFoundError:
            raise
        except OSError as e:
            raise StoreError(f"{self.url}/{rel}: cannot read it ({e})") from e
        self._count(len(data), 1)
        return data

    def read_ranges(self, rel: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Byte ranges [start, end) of object `rel`: one ranged GET each, concurrent where the
        filesystem is asynchronous (s3fs, gcsfs, adlfs)."""
        if not ranges:
            return []
        path = self.path(rel)
        try:
            datas = self.fs.cat_ranges([path] * len(ranges), [a for a, _ in ranges], [b for _, b in ranges],
                                       on_error="return")
        except OSError as e:
            raise StoreError(f"{self.url}/{rel}: cannot read it ({e})") from e
        for data in datas:
            if isinstance(data, FileNotFoundError):
                raise StoreError(f"{self.url}/{rel}: listed in the manifest but missing") from data
            if isinstance(data, BaseException):
                raise StoreError(f"{self.url}/{rel}: cannot read it ({data}); if it is shorter than the "
                                 "manifest says, it was truncated or replaced") from data
        self._count(sum(len(d) for d in datas), len(datas))
        return datas

    def sizes(self, rel: str = "") -> dict[str, int]:
        """Name -> bytes of the objects directly under `rel` ({} if there are none): one listing."""
        try:
            found = self.fs.ls(self.path(rel), detail=True, refresh=True)
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise StoreError(f"{self.url}: cannot list {rel or 'the store'} ({e})") from e
        return {f["name"].rstrip("/").rsplit("/", 1)[-1]: int(f.get("size") or 0)
                for f in found if f.get("type", "file") == "file"}

    def sha256(self, rel: str) -> tuple[int, str]:
        """(bytes, hex SHA-256) of object `rel`, streamed: nothing is kept."""
        try:
            with self.fs.open(self.path(rel), "rb", block_size=CHUNK) as f:
                size, digest = sha256_of(f)
        except FileNotFoundError:
            raise StoreError(f"{self.url}/{rel}: listed in the manifest but missing") from None
        except OSError as e:
            raise StoreError(f"{self.url}/{rel}: cannot read it ({e})") from e
        self._count(size, 1)
        return size, digest

    def _count(self, nbytes: int, requests: int) -> None:
        with self._stats_lock:
            self.bytes_read += nbytes
            self.requests += requests

    def size(self, rel: str) -> int | None:
        """Bytes in object `rel`, None if there is no such object."""
        try:
            info = self.fs.info(self.path(rel), refresh=True) if _takes_refresh(self.fs) \
                else self.fs.info(self.path(rel))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"{self.url}/{rel}: cannot read it ({e})") from e
        return int(info["size"]) if info.get("type", "file") == "file" else None

    def write(self, rel: str, data: bytes) -> None:
        """One PUT: on an object store the object appears whole or not at all."""
        self.fs.pipe_file(self.path(rel), data)

    def upload(self, local: Path, rel: str) -> None:
        self.fs.put_file(str(local), self.path(rel))

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(rel))


def _takes_refresh(fs: Any) -> bool:
    import inspect

    try:
        return "refresh" in inspect.signature(fs.info).parameters
    except (TypeError, ValueError):
        return False


class BlockCache:
    """Byte ranges of a store's objects, read with ranged GETs in fixed-size aligned blocks and kept
    in memory (bounded by bytes, least recently used evicted).

    A read fetches only the blocks it touches that are not held, all in one concurrent batch (one
    GET per block on an async filesystem such as s3fs), so a range costs at most two blocks more
    than its own bytes; the block around a row is its readahead. `prefetch` reads blocks in a
    background thread; a read that wants a block being prefetched waits for it instead of asking
    twice. Every GET must return exactly the bytes asked for: a short answer means the object is
    shorter than the manifest says (truncated or replaced), and is an error naming the object."""

    def __init__(self, remote: Remote, sizes: dict[str, int], *, block_bytes: int | None = None,
                 max_bytes: int | None = None):
        self.remote = remote
        self.sizes = sizes  # rel -> object size, as listed when the store was opened
        self.block = block_bytes or int(os.environ.get("HOOKSCOPE_BLOCK_BYTES", 4 << 20))
        self.max_bytes = max_bytes if max_bytes is not None else int(
            os.environ.get("HOOKSCOPE_CACHE_BYTES", 1 << 30))
        if self.block < 1 or self.max_bytes < 0:
            raise StoreError(f"block size ({self.block}) must be >= 1 and cache size ({self.max_bytes}) >= 0")
        self._blocks: OrderedDict[tuple[str, int], bytes] = OrderedDict()  # oldest first
        self._held = 0
        self._pending: dict[tuple[str, int], Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="hookscope-readahead")

    def read(self, rel: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of object `rel`."""
        return self.read_many(rel, [(start, end)])[0]

    def read_many(self, rel: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Several ranges of one object, their missing blocks fetched in one concurrent batch."""
        wanted = sorted({b for start, end in ranges for b in self._span(rel, start, end)})
        got = self._gather(rel, wanted)
        out = []
        for start, end in ranges:
            first = start // self.block
            joined = b"".join(got[b] for b in self._span(rel, start, end))
            out.append(joined[start - first * self.block : end - first * self.block])
        return out

    def prefetch(self, rel: str, ranges: list[tuple[int, int]]) -> None:
        """Start reading `ranges` of `rel` into the cache in the background; errors are left for
        the foreground read of the same bytes to raise."""
        with self._lock:
            missing = sorted({b for start, end in ranges for b in self._span(rel, start, end)
                              if (rel, b) not in self._blocks and (rel, b) not in self._pending})
            if not missing:
                return
            future = self._pool.submit(self._fetch, rel, missing)
            for b in missing:
                self._pending[(rel, b)] = future

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._blocks.clear()
            self._held = 0

    def _span(self, rel: str, start: int, end: int) -> range:
        size = self.sizes.get(rel)
        if size is None or not 0 <= start <= end <= size:
            raise StoreError(f"{self.remote.url}/{rel}: bytes {start}-{end} asked for, but the object has "
                             f"{size} bytes")
        return range(start // self.block, -(-end // self.block)) if end > start else range(0)

    def _gather(self, rel: str, wanted: list[int]) -> dict[int, bytes]:
        got: dict[int, bytes] = {}
        waits: list[Future] = []
        missing = []
        with self._lock:
            for b in wanted:
                if (rel, b) in self._blocks:
                    self._blocks.move_to_end((rel, b))
                    got[b] = self._blocks[(rel, b)]
                elif (rel, b) in self._pending:
                    waits.append(self._pending[(rel, b)])
                else:
                    missing.append(b)
        if missing:
            got.update(self._fetch(rel, missing))
        for future in waits:
            try:
                got.update({b: data for b, data in future.result().items() if b in wanted})
            except Exception:  # noqa: BLE001 - the prefetch failed: read those blocks here and raise
                pass
        left = [b for b in wanted if b not in got]
        if left:
            got.update(self._fetch(rel, left))
        return got

    def _fetch(self, rel: str, blocks: list[int]) -> dict[int, bytes]:
        size = self.sizes[rel]
        ranges = [(b * self.block, min((b + 1) * self.block, size)) for b in blocks]
        try:
            datas = self.remote.read_ranges(rel, ranges)
        finally:
            with self._lock:
                for b in blocks:
                    self._pending.pop((rel, b), None)
        got = {}
        for b, (start, end), data in zip(blocks, ranges, datas, strict=True):
            if len(data) != end - start:
                raise StoreError(f"{self.remote.url}/{rel}: bytes {start}-{end} came back as {len(data)} "
                                 f"bytes: the object is shorter than the {size} the store listed (truncated "
                                 "or replaced while being read); re-open the store")
            got[b] = data
        with self._lock:
            for b, data in got.items():
                if (rel, b) not in self._blocks:
                    self._blocks[(rel, b)] = data
                    self._held += len(data)
            while self._held > self.max_bytes and self._blocks:
                _, old = self._blocks.popitem(last=False)
                self._held -= len(old)
        return got
