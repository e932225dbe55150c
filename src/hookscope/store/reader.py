"""Read a store: memory-mapped shards, checksums on request, tensors, numpy and `datasets` export.

A shard is checked before safetensors sees it (size against the manifest, the 8-byte header length
against the file size, every tensor's byte range inside the file), so a truncated or corrupt file
gives a StoreError naming it rather than a crash or a huge allocation.

A store at a URL is read with ranged GETs: a shard's header with one small GET, checked the same way
and against the manifest (identity, every column's dtype, shape and byte length), then only the byte
ranges of the columns and rows asked for, through a bounded in-memory block cache (store/fs.py).
The whole-shard SHA-256 needs every byte, so only `verify()` checks it (docs/store-format.md).
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import math
import os
import re
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from ..errors import StoreError
from .fs import BlockCache, Extent, Remote, is_remote, local_path, sha256_of
from .manifest import IDENTITY, MANIFEST, SHARDS_DIR, Column, Manifest, PointStats, ShardEntry

if TYPE_CHECKING:
    import datasets

    from .dataset import ActivationDataset

_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
_HEADER_GET = 16 << 10  # the first ranged GET of a remote shard: its header is a few KiB, so one GET does
_HEADER_BATCH = 16  # a remote header is fetched with those of the next shards not known yet: one round trip
_READ_AHEAD = 2  # shards whose columns a sequential scan of a remote store fetches ahead
# safetensors' dtype codes, by the torch dtype names the manifest uses
_SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
                       "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
                       "bool": "BOOL"}


def open_store(path: str | os.PathLike, *, verify: bool = False) -> Store:
    """Open the store at `path` (a directory with manifest.json, or a URL such as s3://bucket/dir:
    see store/fs.py); `verify=True` also checks every shard's size and SHA-256 against the manifest.
    A remote store is read with ranged GETs of only the columns and rows asked for, through a
    bounded in-memory cache, reading ahead on sequential scans; reading works as it does locally."""
    if is_remote(path):
        return _open_remote(Remote(os.fspath(path)), verify)
    root = local_path(path)
    if not root.is_dir():
        raise StoreError(f"{root}: no such store directory")
    if not (root / MANIFEST).exists() and any(root.glob("manifest.rank*.json")):
        raise StoreError(_UNMERGED.format(root=root))
    store = Store(root, Manifest.load(root / MANIFEST))
    missing = [s.file for s in store.manifest.shards if not (root / s.file).is_file()]
    if missing:
        raise StoreError(f"{root}: {len(missing)} shard file(s) listed in the manifest are missing or not "
                         f"regular files, e.g. {missing[0]}")
    if verify:
        store.verify()
    return store


_UNMERGED = ("{root}: only per-rank manifests here; the torchrun job did not finish. Re-run it with "
             "any number of processes (it resumes), or merge them with "
             "hookscope.store.merge_rank_manifests(path)")


def _open_remote(remote: Remote, verify: bool) -> Store:
    names = remote.list()
    if not names:
        raise StoreError(f"{remote}: no such store (nothing at that URL)")
    if MANIFEST not in names:
        if any(n.startswith("manifest.rank") for n in names):
            raise StoreError(_UNMERGED.format(root=remote))
        raise StoreError(f"{remote}/{MANIFEST}: no manifest here; is this a hookscope store?")
    manifest = Manifest.from_bytes(remote.read(MANIFEST), f"{remote}/{MANIFEST}")
    sizes = {f"{SHARDS_DIR}/{name}": size for name, size in remote.sizes(SHARDS_DIR).items()}
    store = Store(remote.url, manifest, remote, sizes)
    missing = [s.file for s in store.manifest.shards if s.file not in sizes]
    if missing:
        raise StoreError(f"{remote}: {len(missing)} shard object(s) listed in the manifest are missing, "
                         f"e.g. {missing[0]}")
    if verify:
        store.verify()
    return store


class Store:
    """A read-only view of a store directory. `len(store)` is the number of rows (tokens)."""

    def __init__(self, path: Path | str, manifest: Manifest, remote: Remote | None = None,
                 sizes: dict[str, int] | None = None):
        self.path = path  # a Path, or the URL (a str) of a remote store
        self.manifest = manifest
        self.remote = remote
        self._blocks = BlockCache(remote, sizes or {}) if remote else None
        self._headers: dict[int, tuple[int, dict[str, Any]]] = {}  # remote shard -> (data offset, header)
        self._heads: dict[int, bytes] = {}  # remote shard -> first bytes, fetched with another's, unchecked
        self._header_lock = threading.Lock()
        self._fetching = threading.Lock()
        self._last_scanned = -1  # the last remote shard read whole: a sequential scan reads ahead
        self._ahead: dict[int, Future] = {}  # remote shard -> its readahead, header and columns
        self._readahead = ThreadPoolExecutor(_READ_AHEAD, thread_name_prefix="hookscope-readahead") \
            if remote else None
        if self._readahead is not None:  # stop reading ahead when the store goes
            weakref.finalize(self, self._readahead.shutdown, wait=False, cancel_futures=True)
        self._starts = [0]
        for s in manifest.shards:
            self._starts.append(self._starts[-1] + s.rows)
        self._cache: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def points(self) -> dict[str, Column]:
        """Activation columns: name -> per-row shape and dtype."""
        return self.manifest.points

    @property
    def meta(self) -> dict[str, Column]:
        """Integer columns that trace each row to its token: token_ids, doc_ids, positions, seq_ids."""
        return self.manifest.meta

    @property
    def stats(self) -> dict[str, PointStats]:
        return self.manifest.stats

    @property
    def num_shards(self) -> int:
        return len(self.manifest.shards)

    def __len__(self) -> int:
        return self.manifest.rows

    def first_row(self, i: int) -> int:
        """Global index of shard `i`'s first row."""
        return self._starts[i]

    def __repr__(self) -> str:
        return (f"Store({str(self.path)!r}, rows={len(self)}, shards={self.num_shards}, "
                f"points={list(self.points)})")

    def shard(self, i: int) -> dict[str, torch.Tensor]:
        """Every column of shard `i`, memory-mapped (pages are read when touched); on a URL, read
        into memory (through the bounded block cache, not kept by the store)."""
        if self._blocks is not None:
            return self.load_shard(i)
        if i not in self._cache:
            self._cache[i] = self.load_shard(i)
        return self._cache[i]

    def load_shard(self, i: int, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Columns `names` (default all) of shard `i`, checked and memory-mapped; not cached."""
        entry = self.manifest.shards[i]
        names = list(self.manifest.columns) if names is None else list(names)
        self._check_names(names)
        if self._blocks is None:
            return self._load_local(self.path / entry.file, entry, names)
        ahead = self._ahead.pop(i, None)
        if ahead is not None:  # being read ahead: let it finish (its errors are raised below, by this read)
            with contextlib.suppress(CancelledError):
                ahead.exception()
        if i in (0, self._last_scanned + 1):  # a sequential scan: read the next shards ahead
            self._remote_header(i)  # first: its batch brings the next shards' headers too
            for j in range(i + 1, min(i + 1 + _READ_AHEAD, self.num_shards)):
                self._read_ahead(j, names)
        self._last_scanned = i
        return self._load_remote(i, names, 0, entry.rows)

    def read_ahead(self, shards: Sequence[int], names: Sequence[str] | None = None) -> None:
        """On a URL, start fetching columns `names` of `shards` into the block cache in the background,
        so a window of shards comes in concurrently and `load_shard` then waits only for what is left.
        A local store needs nothing (its pages come from the page cache)."""
        if self._blocks is None:
            return
        names = list(self.manifest.columns) if names is None else list(names)
        self._check_names(names)
        row = sum(_row_bytes(self.manifest.columns[n]) for n in names)
        if sum(self.manifest.shards[i].rows for i in shards) * row > self._blocks.max_bytes // 2:
            return  # they would push each other out of the cache before being read
        for i in shards:
            self._read_ahead(i, names)

    def rows(self, start: int, stop: int, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Rows [start, stop) of columns `names` (default all), in store order, as tensors. On a URL
        only those rows' bytes are fetched (a column's rows are contiguous in a shard)."""
        names = list(self.manifest.columns) if names is None else list(names)
        self._check_names(names)
        if not 0 <= start <= stop <= len(self):
            raise StoreError(f"{self.path}: rows {start}:{stop} asked for, the store has rows 0:{len(self)}")
        parts = []
        i = bisect.bisect_right(self._starts, start) - 1
        while start < stop:
            lo, hi = start - self._starts[i], min(stop, self._starts[i + 1]) - self._starts[i]
            if hi > lo:
                parts.append(self._load_remote(i, names, lo, hi) if self._blocks is not None
                             else {k: v[lo:hi] for k, v in ((k, self.shard(i)[k]) for k in names)})
            start, i = self._starts[i] + hi, i + 1
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return {k: _tensor(b"", self.manifest.columns[k], 0) for k in names}
        return {k: torch.cat([p[k] for p in parts]) for k in names}

    def _load_remote(self, i: int, names: list[str], lo: int, hi: int) -> dict[str, torch.Tensor]:
        """Rows [lo, hi) of columns `names` of remote shard `i`: one byte range per column."""
        assert self._blocks is not None
        entry = self.manifest.shards[i]
        ranges = self._column_ranges(i, names, lo, hi)
        datas = self._blocks.read_many(entry.file, ranges)
        return {name: _tensor(data, self.manifest.columns[name], hi - lo)
                for name, data in zip(names, datas, strict=True)}

    def _column_ranges(self, i: int, names: list[str], lo: int, hi: int) -> list[tuple[Extent, int, int]]:
        """(the column's extent in the object, start, end) of rows [lo, hi) of each column."""
        data_start, header = self._remote_header(i)
        ranges = []
        for name in names:
            begin, end = (data_start + o for o in header[name]["data_offsets"])
            row = _row_bytes(self.manifest.columns[name])
            ranges.append(((begin, end), begin + lo * row, begin + hi * row))
        return ranges

    def _read_ahead(self, i: int, names: list[str]) -> None:
        """Fetch shard `i`'s header and columns `names` into the block cache in the background. A
        damaged shard is reported when it is read, not here."""
        assert self._readahead is not None and self._blocks is not None
        rows = self.manifest.shards[i].rows
        if rows * sum(_row_bytes(self.manifest.columns[n]) for n in names) * _READ_AHEAD \
                > self._blocks.max_bytes // 2:  # it would push out what it was fetched for
            return
        if i not in self._ahead:
            self._ahead[i] = self._readahead.submit(self._fetch_ahead, i, names)

    def _fetch_ahead(self, i: int, names: list[str]) -> None:
        assert self._blocks is not None
        ranges = self._column_ranges(i, names, 0, self.manifest.shards[i].rows)
        self._blocks.read_many(self.manifest.shards[i].file, ranges)

    def _remote_header(self, i: int) -> tuple[int, dict[str, Any]]:
        """(offset of the first data byte, safetensors header) of remote shard `i`: one small ranged
        GET, checked against the object's size and the manifest before any data is read."""
        with self._header_lock:
            if i in self._headers:
                return self._headers[i]
        assert self._blocks is not None and self.remote is not None
        entry = self.manifest.shards[i]
        where = f"{self.path}/{entry.file}"
        size = self._blocks.sizes.get(entry.file)
        if size is None:
            raise StoreError(f"{where}: listed in the manifest but missing")
        if size != entry.bytes:
            raise StoreError(f"{where}: {size} bytes but the manifest says {entry.bytes}: the shard is "
                             "truncated or was replaced; re-run the extraction into a new store")
        if size < 8:
            raise StoreError(f"{where}: {size} bytes, too short for a safetensors header: truncated")
        with self._fetching:  # one batch of heads at a time: threads reading ahead would ask twice
            with self._header_lock:
                if i in self._headers:
                    return self._headers[i]
                head = self._heads.pop(i, None)
            if head is None:
                head = self._fetch_heads(i)
        if len(head) != min(size, _HEADER_GET):
            raise StoreError(f"{where}: its first {min(size, _HEADER_GET)} bytes came back as {len(head)}: "
                             "the object is shorter than listed (truncated or replaced); re-open the store")
        n = int.from_bytes(head[:8], "little")
        _check_header_length(where, n, size)
        raw = head[8 : 8 + n]
        if len(raw) < n:  # a header longer than the first GET: one more for the rest
            raw += self._get(entry.file, len(head), 8 + n, where)
        header = _parse_header(where, raw, size - 8 - n)
        _check_identity(where, header, entry, self.manifest.settings_hash)
        _check_columns(where, header, entry, self.manifest.columns)
        with self._header_lock:
            self._headers[i] = (8 + n, header)
        return 8 + n, header

    def _fetch_heads(self, i: int) -> bytes:
        """Remote shard `i`'s first bytes (its header, unchecked). The next shards whose headers
        are not known yet, and whose listed size is right, come in the same concurrent batch: a
        scan, sequential or shuffled, waits one round trip per batch of headers, not per shard."""
        assert self.remote is not None and self._blocks is not None
        shards, sizes = self.manifest.shards, self._blocks.sizes
        batch = [i] + [j for j in range(i + 1, min(i + _HEADER_BATCH, len(shards)))
                       if j not in self._headers and j not in self._heads
                       and sizes.get(shards[j].file) == shards[j].bytes][: _HEADER_BATCH - 1]
        datas = self.remote.read_parts([(shards[j].file, 0, min(sizes[shards[j].file], _HEADER_GET))
                                        for j in batch])
        with self._header_lock:
            for j, data in zip(batch[1:], datas[1:], strict=True):
                if isinstance(data, bytes):
                    self._heads[j] = data
            while len(self._heads) > 4 * _HEADER_BATCH:  # heads of shards never read: keep a few
                self._heads.pop(next(iter(self._heads)))
        if isinstance(datas[0], StoreError):
            raise datas[0]
        return datas[0]

    def _get(self, rel: str, start: int, end: int, where: str) -> bytes:
        assert self.remote is not None
        data = self.remote.read_ranges(rel, [(start, end)])[0]
        if len(data) != end - start:
            raise StoreError(f"{where}: bytes {start}-{end} came back as {len(data)} bytes: the object is "
                             "shorter than listed (truncated or replaced); re-open the store")
        return data

    def column_offsets(self, i: int, names: Sequence[str]) -> tuple[Path, dict[str, int]] | None:
        """Local shard `i`'s file and where each column of `names` starts in it (a byte offset),
        after the checks `load_shard` makes (size, header, identity, dtypes, shapes, byte counts):
        what mapping the file by hand needs. None on a URL (no file), or for a dtype safetensors has
        no code for here."""
        if self._blocks is not None or any(self.manifest.columns[n].dtype not in _SAFETENSORS_DTYPES
                                           for n in names):
            return None
        entry = self.manifest.shards[i]
        path = self.path / entry.file
        data_start, header = _read_header(path, _checked_size(path, entry))
        _check_identity(path, header, entry, self.manifest.settings_hash)
        _check_columns(path, header, entry, {n: self.manifest.columns[n] for n in names})
        return path, {n: data_start + header[n]["data_offsets"][0] for n in names}

    def _load_local(self, path: Path, entry: ShardEntry, names: list[str]) -> dict[str, torch.Tensor]:
        _, header = _read_header(path, _checked_size(path, entry))
        try:
            with safe_open(path, framework="pt") as f:
                out = {name: f.get_tensor(name) for name in names}
        except (SafetensorError, KeyError, OSError, RuntimeError) as e:
            raise StoreError(f"{path}: cannot read the shard ({e}); it is corrupt") from e
        _check_identity(path, header, entry, self.manifest.settings_hash)
        for name, t in out.items():
            col = self.manifest.columns[name]
            if (name not in header or tuple(t.shape) != (entry.rows, *col.shape)
                    or str(t.dtype) != "torch." + col.dtype):
                raise StoreError(f"{path}: column {name!r} is {tuple(t.shape)} {t.dtype}, the manifest says "
                                 f"{(entry.rows, *col.shape)} {col.dtype}")
        return out

    def verify(self) -> None:
        """Check every shard's size, SHA-256, header, identity and columns against the manifest (a
        manifest can vouch for a damaged file); raise StoreError naming each bad shard."""
        bad = []
        for i, entry in enumerate(self.manifest.shards):
            if self.remote is not None:
                problem = self._check_remote_shard(i)
                if problem:
                    bad.append(f"{entry.file}: {problem}")
                continue
            problem = _check_shard(self.path / entry.file, entry)
            if problem is None:
                try:
                    self.load_shard(i)
                except StoreError as e:
                    problem = str(e).removeprefix(f"{self.path}/{entry.file}: ")
            if problem:
                bad.append(f"{entry.file}: {problem}")
        if bad:
            raise StoreError(f"{self.path}: {len(bad)} of {self.num_shards} shards are damaged:\n  "
                             + "\n  ".join(bad) + "\nRe-run the extraction into a new directory.")

    def _check_remote_shard(self, i: int) -> str | None:
        """What is wrong with remote shard `i` (header, identity, columns, then every byte's
        SHA-256, streamed), or None."""
        assert self.remote is not None
        entry = self.manifest.shards[i]
        try:
            with self._header_lock:
                self._headers.pop(i, None)  # check the object as it is now
                self._heads.pop(i, None)
            self._remote_header(i)
            size, digest = self.remote.sha256(entry.file)
        except StoreError as e:
            return str(e).removeprefix(f"{self.path}/{entry.file}: ")
        if size != entry.bytes:
            return f"{size} bytes, the manifest says {entry.bytes} (truncated or replaced)"
        if digest != entry.sha256:
            return "SHA-256 differs from the manifest (corrupt)"
        return None

    def tensor(self, name: str) -> torch.Tensor:
        """Column `name` of every row, in store order, as one in-memory tensor (for small stores)."""
        self._check_names([name])
        if not self.manifest.shards:
            col = self.manifest.columns[name]
            return torch.empty((0, *col.shape), dtype=getattr(torch, col.dtype))
        if self._blocks is not None:  # only this column's bytes
            return torch.cat([self.load_shard(i, [name])[name] for i in range(self.num_shards)])
        return torch.cat([self.shard(i)[name] for i in range(self.num_shards)])

    def __getitem__(self, row: int) -> dict[str, torch.Tensor]:
        """Every column of one row (map-style access, e.g. for a DataLoader with shuffle=True)."""
        n = len(self)
        if not -n <= row < n:
            raise IndexError(f"row {row} out of range for a store of {n} rows")
        row %= n
        if self._blocks is not None:  # that row's bytes (and the rest of their blocks: readahead)
            return {k: v[0] for k, v in self.rows(row, row + 1).items()}
        i = bisect.bisect_right(self._starts, row) - 1
        return {k: v[row - self._starts[i]] for k, v in self.shard(i).items()}

    def to_numpy(self, name: str) -> np.ndarray:
        """Column `name` as a numpy array; bfloat16 (which numpy lacks) becomes float32."""
        return _numpy(self.tensor(name))

    def to_hf_dataset(self, names: Sequence[str] | None = None, *,
                      cache_dir: str | None = None) -> datasets.Dataset:
        """A Hugging Face `datasets.Dataset` with one example per row, memory-mapped from a folder
        written once by `hookscope.export.export_hf` under `cache_dir` (default: the datasets cache)
        and reused while the store is unchanged. Fixed-shape features; bfloat16 becomes float32."""
        try:
            import datasets
        except ImportError as e:
            raise StoreError("to_hf_dataset needs the `datasets` package: "
                             "pip install 'hookscope[datasets]'") from e
        from ..export import export_hf  # the export room builds on this one; imported only here

        names = list(self.manifest.columns) if names is None else list(names)
        self._check_names(names)
        key = hashlib.sha256(json.dumps([self.manifest.to_json(), names], sort_keys=True).encode())
        key = key.hexdigest()
        folder = Path(cache_dir or datasets.config.HF_DATASETS_CACHE) / "hookscope" / key[:32]
        if not (folder / "state.json").is_file():
            export_hf(self, folder, names, overwrite=folder.exists(), progress=False)
        return datasets.load_from_disk(str(folder))

    def dataset(self, point: str | Sequence[str], *, shuffle: bool = True, seed: int = 0,
                buffer_rows: int = 1 << 18, split: str | None = None, val_fraction: float = 0.1,
                rank: int = 0, world_size: int = 1, epoch: int = 0, batch_size: int | None = None,
                drop_last: bool = False, repeat: bool = False, prefetch: bool = True) -> ActivationDataset:
        """A shuffled `IterableDataset` over column(s) `point`; see `ActivationDataset`
        (`repeat=True`: one `iter()` runs through epoch after epoch, for trainers that call `next()`)."""
        from .dataset import ActivationDataset

        return ActivationDataset(self, point, shuffle=shuffle, seed=seed, buffer_rows=buffer_rows,
                                 split=split, val_fraction=val_fraction, rank=rank, world_size=world_size,
                                 epoch=epoch, batch_size=batch_size, drop_last=drop_last, repeat=repeat,
                                 prefetch=prefetch)

    def top(self, point: str, unit: int, **kwargs: Any) -> Any:
        """The top-activating contexts of `unit` of `point` (see hookscope.top.top; g-top's room)."""
        from ..top import top  # imported here: the top room builds on the store, not the reverse
        return top(self, point, unit, **kwargs)

    def _check_names(self, names: Sequence[str]) -> None:
        unknown = [n for n in names if n not in self.manifest.columns]
        if unknown:
            raise StoreError(f"{self.path}: no column {unknown[0]!r}; "
                             f"the store has {list(self.manifest.columns)}")


def _numpy(t: torch.Tensor) -> np.ndarray:
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as e:
        raise StoreError(f"{path}: cannot read the shard ({e})") from e


def _checked_size(path: Path, entry: ShardEntry) -> int:
    size = _file_size(path)
    if size != entry.bytes:
        raise StoreError(f"{path}: {size} bytes but the manifest says {entry.bytes}: the shard is "
                         "truncated or was replaced; re-run the extraction into a new directory")
    return size


def _read_header(path: Path, size: int) -> tuple[int, dict[str, Any]]:
    """(offset of the first data byte, the safetensors JSON header), after checking that the header
    and every tensor's bytes lie in the file."""
    if size < 8:
        raise StoreError(f"{path}: {size} bytes, too short for a safetensors header: truncated")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        _check_header_length(path, n, size)
        raw = f.read(n)
    return 8 + n, _parse_header(path, raw, size - 8 - n)


def _check_header_length(where: Path | str, n: int, size: int) -> None:
    if n > size - 8 or n > _MAX_HEADER:
        raise StoreError(f"{where}: header length {n} does not fit in a file of {size} bytes: "
                         "truncated or corrupt")


def _parse_header(where: Path | str, raw: bytes, data: int) -> dict[str, Any]:
    """The header's JSON, every tensor's byte range checked to lie within the `data` bytes after it."""
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # ValueError: bad UTF-8 or JSON, or a 5,000-digit int
        raise StoreError(f"{where}: the safetensors header is not valid JSON ({type(e).__name__}): "
                         "corrupt") from e
    if not isinstance(header, dict):
        raise StoreError(f"{where}: the safetensors header is not a JSON object: corrupt")
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data):
            raise StoreError(f"{where}: tensor {name!r} has byte range {offsets} outside the {data} "
                             "data bytes: truncated or corrupt")
    return header


def _row_bytes(col: Column) -> int:
    return math.prod(col.shape) * getattr(torch, col.dtype).itemsize


def _tensor(data: bytes, col: Column, rows: int) -> torch.Tensor:
    """A column's rows from their little-endian bytes (safetensors' layout), copied into a tensor."""
    dtype = getattr(torch, col.dtype)
    if not data:
        return torch.empty((rows, *col.shape), dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(rows, *col.shape)


def _check_columns(where: Path | str, header: dict[str, Any], entry: ShardEntry,
                   columns: dict[str, Column]) -> None:
    """Each of `columns` is in the header with the manifest's dtype and shape, spanning exactly its
    rows' bytes."""
    for name, col in columns.items():
        info = header.get(name)
        want = (_SAFETENSORS_DTYPES.get(col.dtype), [entry.rows, *col.shape])
        got = (info.get("dtype"), info.get("shape")) if isinstance(info, dict) else None
        if got != want:
            raise StoreError(f"{where}: column {name!r} is {got} in the shard's header, the manifest "
                             f"says {want}: corrupt, or from another store")
        start, end = info["data_offsets"]
        if end - start != entry.rows * _row_bytes(col):
            raise StoreError(f"{where}: column {name!r} spans {end - start} bytes, its {entry.rows} rows "
                             f"need {entry.rows * _row_bytes(col)}: corrupt")


def _check_identity(path: Path | str, header: dict[str, Any], entry: ShardEntry, settings_hash: str) -> None:
    meta = header.get("__metadata__")
    got = meta.get(IDENTITY) if isinstance(meta, dict) else None
    want = entry.identity(settings_hash)
    if got == want:
        return
    if got is None:
        raise StoreError(f"{path}: the shard has no {IDENTITY!r} entry in its metadata (it was not written "
                         "by a hookscope ShardWriter); re-run the extraction into a new directory")

    def short(identity: str) -> str:  # settings hashes cut to 12 digits
        return re.sub(r"\b([0-9a-f]{12})[0-9a-f]{52}\b", r"\1...", identity)

    raise StoreError(f"{path}: the shard holds {short(got)!r}, but the manifest lists it as {short(want)!r}: "
                     "it was copied from another store or moved within this one; re-run the extraction into "
                     "a new directory")


def _check_shard(path: Path, entry: ShardEntry) -> str | None:
    try:
        size = path.stat().st_size
        if size != entry.bytes:
            return f"{size} bytes, the manifest says {entry.bytes} (truncated or replaced)"
        with open(path, "rb") as f:
            _, digest = sha256_of(f)
    except OSError as e:
        return f"cannot read it ({e})"
    if digest != entry.sha256:
        return "SHA-256 differs from the manifest (corrupt)"
    return None
