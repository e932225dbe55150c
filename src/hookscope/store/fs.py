"""Where a store's bytes live: a local directory, or a URL on an fsspec filesystem.

A local path (or `file://`) keeps the POSIX path the writer and reader always had: write `.tmp`,
fsync, rename, fsync the directory. Any other URL (`s3://`, `gs://`, `az://`, `hf://`,
`memory://`) goes through that scheme's fsspec filesystem (`pip install 'hookscope[s3]'`, `[gcs]`,
`[azure]`, `[hf]`). Object stores have no atomic rename, so there a shard object is uploaded under
its final name first and the manifest object, written in one PUT, is the commit point: a shard
that the manifest does not list does not exist for readers, and the next writer deletes it.
Reading a URL uses ranged GETs through `BlockCache` (only the bytes asked for, kept in memory).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import StoreError

CHUNK = 1 << 22  # 4 MiB reads: large enough to hash at disk speed, small enough to stay flat in memory

# the extra (pyproject.toml) behind each scheme, for the message when it is missing; hf:// needs none
# (huggingface_hub, which transformers installs, brings its filesystem)
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure",
           "abfss": "azure"}


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
        datas = self.read_parts([(rel, start, end) for start, end in ranges])
        for data in datas:
            if isinstance(data, StoreError):
                raise data
        return datas  # type: ignore[return-value]

    def read_parts(self, parts: list[tuple[str, int, int]]) -> list[bytes | StoreError]:
        """Bytes [start, end) of each (object, start, end), in one concurrent batch of ranged GETs;
        a part that fails is a StoreError in its place, so one damaged object spoils no other."""
        if not parts:
            return []
        try:
            datas = self.fs.cat_ranges([self.path(rel) for rel, _, _ in parts], [a for _, a, _ in parts],
                                       [b for _, _, b in parts], on_error="return")
        except OSError as e:
            raise StoreError(f"{self.url}: cannot read {parts[0][0]} ({e})") from e
        out: list[bytes | StoreError] = []
        for (rel, _, _), data in zip(parts, datas, strict=True):
            if isinstance(data, FileNotFoundError):
                err = StoreError(f"{self.url}/{rel}: listed in the manifest but missing")
            elif isinstance(data, BaseException):
                err = StoreError(f"{self.url}/{rel}: cannot read it ({data}); if it is shorter than the "
                                 "manifest says, it was truncated or replaced")
            else:
                out.append(data)
                continue
            err.__cause__ = data
            out.append(err)
        self._count(sum(len(d) for d in out if isinstance(d, bytes)), len(parts))
        return out

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


def _env_bytes(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise StoreError(f"${name}={text!r}: give a number of bytes, e.g. {default}") from None


Extent = tuple[int, int]  # [start, end) of one tensor's bytes in an object: blocks are cut from its start


class BlockCache:
    """Byte ranges of a store's objects, read with ranged GETs and kept in memory in blocks
    (bounded by bytes, least recently used evicted; thread-safe).

    Blocks are cut from the start of the extent a range lies in (one column of one shard), so a
    whole column is fetched exactly, and a window of rows costs at most two part-blocks more than
    its own bytes; the rest of the block around a row is its readahead. A read fetches the blocks
    it touches that are not held in one concurrent batch (one GET per block; s3fs, gcsfs and adlfs
    send them at once). Every GET must return exactly the bytes asked for: a short answer means the
    object is shorter than listed (truncated or replaced), an error naming the object."""

    def __init__(self, remote: Remote, sizes: dict[str, int], *, block_bytes: int | None = None,
                 max_bytes: int | None = None):
        self.remote = remote
        self.sizes = sizes  # rel -> object size, as listed when the store was opened
        # 8 MiB: the size of ranged GET that object stores serve at full speed, few enough requests
        self.block = block_bytes or _env_bytes("HOOKSCOPE_BLOCK_BYTES", 8 << 20)
        self.max_bytes = max_bytes if max_bytes is not None else _env_bytes("HOOKSCOPE_CACHE_BYTES", 1 << 30)
        if self.block < 1 or self.max_bytes < 0:
            raise StoreError(f"block size ({self.block}) must be >= 1 and cache size ({self.max_bytes}) >= 0")
        self._blocks: OrderedDict[tuple[str, Extent, int], bytes] = OrderedDict()  # oldest first
        self._held = 0
        self._lock = threading.Lock()

    def read_many(self, rel: str, ranges: list[tuple[Extent, int, int]]) -> list[bytes]:
        """Bytes [start, end) of object `rel` for each (extent, start, end), the range inside the
        extent; the missing blocks of all of them fetched in one concurrent batch."""
        keys = []
        for extent, start, end in ranges:
            size = self.sizes.get(rel)
            if size is None or not 0 <= extent[0] <= start <= end <= extent[1] <= size:
                raise StoreError(f"{self.remote.url}/{rel}: bytes {start}-{end} of extent {extent} asked "
                                 f"for, but the object has {size} bytes")
            keys.append([(rel, extent, b) for b in self._span(extent, start, end)])
        got: dict[tuple[str, Extent, int], bytes] = {}
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
            first = extent[0] + ks[0][2] * self.block if ks else start
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
        return range((start - extent[0]) // self.block, -(-(end - extent[0]) // self.block))

    def _fetch(self, rel: str, keys: list[tuple[str, Extent, int]]) -> dict[tuple[str, Extent, int], bytes]:
        ranges = [(ext[0] + b * self.block, min(ext[0] + (b + 1) * self.block, ext[1])) for _, ext, b in keys]
        datas = self.remote.read_ranges(rel, ranges)
        for (start, end), data in zip(ranges, datas, strict=True):
            if len(data) != end - start:
                raise StoreError(f"{self.remote.url}/{rel}: bytes {start}-{end} came back as {len(data)} "
                                 f"bytes: the object is shorter than the {self.sizes[rel]} listed when the "
                                 "store was opened (truncated or replaced while read); re-open the store")
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
