"""Read a store: memory-mapped shards, checksums on request, tensors and numpy.

Every shard passes one check before its bytes are read (store/checks.py). A local shard is then
memory-mapped; a shard at a URL is read by byte range, only the columns and rows asked for
(store/ranged.py). The whole-shard checksum needs every byte, so only `verify()` checks it
(docs/store-format.md). Exports and the top-k index are rooms above this one: they take a Store.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from ..errors import StoreError
from .checks import HEAD_BYTES, SAFETENSORS_DTYPES, Header, check_size, checked_header, tensor_of
from .checksum import checksum_of
from .dimstats import StoreStats
from .fs import FS, open_fs
from .journal import load_manifest
from .manifest import MANIFEST, SHARDS_DIR, Column, Manifest
from .ranged import RangedShards
from .stats import stats_header_bytes

if TYPE_CHECKING:
    from .dataset import ActivationDataset

_UNMERGED = (
    "{root}: only per-rank manifests here; the torchrun job did not finish. Re-run it with "
    "any number of processes (it resumes), or merge them with "
    "hookscope.store.merge_rank_manifests(path)"
)


def open_store(
    location: str | os.PathLike, *, verify: bool = False, storage_options: dict[str, Any] | None = None
) -> Store:
    """Open the store at `location` (a directory with manifest.json, `file://DIR`, or a URL such as
    s3://bucket/dir: see store/fs.py); `verify=True` also checks every shard's size and checksum
    against the manifest. A remote store is read with ranged GETs of only the columns and rows asked
    for, through a bounded in-memory cache, reading ahead on sequential scans; reading works as it
    does locally. `storage_options` go to the URL's fsspec filesystem.
    Reading the manifest holds Python's garbage collector back (it makes no cycles), and lets it go
    again before this returns (docs/architecture.md, "Process-wide settings").

    Returns:
        Store: a read-only view: `len(store)` rows, `store.manifest`, columns, `store.dataset(...)`.

    Raises:
        StoreError: no store there, no manifest, shards missing, an unfinished torchrun job's
            per-rank manifests, or (with `verify=True`) a damaged shard, each named."""
    fs = open_fs(location, storage_options)
    names = fs.list()
    if MANIFEST not in names:
        if any(n.startswith("manifest.rank") for n in names):
            raise StoreError(_UNMERGED.format(root=fs))
        if not names:
            raise StoreError(f"{fs}: no such store (no directory or objects there)")
        raise StoreError(f"{fs.where(MANIFEST)}: no manifest here; is this a hookscope store?")
    try:
        manifest = load_manifest(fs, MANIFEST)  # with the shards committed to its journal since
    except FileNotFoundError:
        raise StoreError(f"{fs.where(MANIFEST)}: no manifest here; is this a hookscope store?") from None
    # at a URL the listing's sizes serve the ranged reads; locally a shard's size is read when it is
    sizes = {f"{SHARDS_DIR}/{name}": size for name, size in fs.sizes(SHARDS_DIR).items()} if fs.remote else {}
    present = sizes or {f"{SHARDS_DIR}/{name}" for name in fs.file_names(SHARDS_DIR)}
    missing = [s.file for s in manifest.shards if s.file not in present]
    if missing:
        raise StoreError(
            f"{fs}: {len(missing)} shard file(s) listed in the manifest are missing or not "
            f"regular files, e.g. {missing[0]}"
        )
    store = Store(fs, manifest, sizes)
    if verify:
        store.verify()
    return store


class Store:
    """A read-only view of a store. `len(store)` is the number of rows (tokens); `path` is where it
    lives (a directory or a URL, as a string), `fs` its filesystem. What `hs.open_store` returns.

    Raises:
        StoreError: from its readers, for rows or columns it does not have, or a damaged shard."""

    def __init__(self, fs: FS, manifest: Manifest, sizes: dict[str, int] | None = None):
        self.fs = fs
        self.path: str = fs.url
        self.manifest = manifest
        # at a URL: shards read by byte range, their sizes as listed now (a local one is stat'ed at each read)
        self._ranged = RangedShards(fs, manifest, sizes or {}) if fs.remote else None
        self._starts = [0]
        for s in manifest.shards:
            self._starts.append(self._starts[-1] + s.rows)
        self._cache: dict[int, dict[str, torch.Tensor]] = {}
        self._stats = StoreStats(manifest, self._stats_header, lambda i: fs.where(manifest.shards[i].file))

    @property
    def points(self) -> dict[str, Column]:
        """Activation columns: name -> per-row shape and dtype."""
        return self.manifest.points

    @property
    def meta(self) -> dict[str, Column]:
        """Integer columns that trace each row to its token: token_ids, doc_ids, positions, seq_ids."""
        return self.manifest.meta

    @property
    def stats(self) -> StoreStats:
        """Per point, its `PointStats` over the whole store: the per-dimension mean and M2 merged
        from every shard's header on the first `stats[point]` (then cached); the scalar statistics
        alone, read from the manifest with no shard read: `store.manifest.stats`."""
        return self._stats

    @property
    def num_shards(self) -> int:
        return len(self.manifest.shards)

    def __len__(self) -> int:
        return self.manifest.rows

    def first_row(self, i: int) -> int:
        """Global index of shard `i`'s first row."""
        return self._starts[i]

    def __repr__(self) -> str:
        return (
            f"Store({str(self.path)!r}, rows={len(self)}, shards={self.num_shards}, "
            f"points={list(self.points)})"
        )

    def shard(self, i: int) -> dict[str, torch.Tensor]:
        """Every column of shard `i`, memory-mapped (pages are read when touched); on a URL, read
        into memory (through the bounded block cache, not kept by the store)."""
        if self._ranged is not None:
            return self.load_shard(i)
        if i not in self._cache:
            self._cache[i] = self.load_shard(i)
        return self._cache[i]

    def load_shard(self, i: int, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Columns `names` (default all) of shard `i`, checked and memory-mapped; not cached."""
        names = self.column_names(names)
        if self._ranged is not None:
            return self._ranged.load(i, names)
        path = self.fs.local(self.manifest.shards[i].file)
        self.header(i)
        try:
            with safe_open(path, framework="pt") as f:
                return {name: f.get_tensor(name) for name in names}
        except (SafetensorError, KeyError, OSError, RuntimeError) as e:
            raise StoreError(f"{path}: cannot read the shard ({e}); it is corrupt") from e

    def header(self, i: int, fresh: bool = False) -> Header:
        """(offset of the first data byte, safetensors header) of shard `i`, after the one check
        every shard passes (store/checks.py); `fresh`: as the file is now, not as first read."""
        if self._ranged is not None:
            return self._ranged.header(i, fresh)
        entry = self.manifest.shards[i]
        where = self.fs.where(entry.file)
        size = check_size(where, self.fs.size(entry.file), entry)
        head = self.fs.read_ranges(entry.file, [(0, min(size, HEAD_BYTES))])[0]
        return checked_header(
            where,
            head,
            size,
            entry,
            self.manifest.settings_hash,
            self.manifest.columns,
            lambda start, end: self.fs.read_ranges(entry.file, [(start, end)])[0],
        )

    def _stats_header(self, i: int) -> Header:
        """Shard `i`'s checked header with its per-dimension statistics (not kept: headers a
        reader caches leave them out), in one read where the statistics fit the first bytes."""
        entry = self.manifest.shards[i]
        where = self.fs.where(entry.file)
        size = check_size(
            where,
            self.fs.size(entry.file) if self._ranged is None else self._ranged.blocks.sizes.get(entry.file),
            entry,
        )
        first = min(size, HEAD_BYTES + stats_header_bytes(self.manifest.points))
        head = self.fs.read_ranges(entry.file, [(0, first)])[0]
        return checked_header(
            where,
            head,
            size,
            entry,
            self.manifest.settings_hash,
            self.manifest.columns,
            lambda start, end: self.fs.read_ranges(entry.file, [(start, end)])[0],
            keep_stats=True,
        )

    def read_ahead(self, shards: Sequence[int], names: Sequence[str] | None = None) -> None:
        """On a URL, start fetching columns `names` of `shards` into the block cache in the background,
        so a window of shards comes in concurrently and `load_shard` then waits only for what is left.
        A local store needs nothing (its pages come from the page cache)."""
        if self._ranged is not None:
            self._ranged.read_ahead(shards, self.column_names(names))

    def rows(self, start: int, stop: int, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Rows [start, stop) of columns `names` (default all), in store order, as tensors. On a URL
        only those rows' bytes are fetched (a column's rows are contiguous in a shard)."""
        names = self.column_names(names)
        if not 0 <= start <= stop <= len(self):
            raise StoreError(f"{self.path}: rows {start}:{stop} asked for, the store has rows 0:{len(self)}")
        parts = []
        i = bisect.bisect_right(self._starts, start) - 1
        while start < stop:
            lo, hi = start - self._starts[i], min(stop, self._starts[i + 1]) - self._starts[i]
            if hi > lo:
                parts.append(
                    self._ranged.rows(i, names, lo, hi)
                    if self._ranged is not None
                    else {k: v[lo:hi] for k, v in ((k, self.shard(i)[k]) for k in names)}
                )
            start, i = self._starts[i] + hi, i + 1
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return {k: tensor_of(b"", self.manifest.columns[k], 0) for k in names}
        return {k: torch.cat([p[k] for p in parts]) for k in names}

    def column_offsets(self, i: int, names: Sequence[str]) -> tuple[Path, dict[str, int]] | None:
        """Local shard `i`'s file and where each column of `names` starts in it (a byte offset),
        after the checks `load_shard` makes: what mapping the file by hand needs. None on a URL
        (no file), or for a dtype safetensors has no code for here."""
        path = self.fs.local(self.manifest.shards[i].file)
        if path is None or any(self.manifest.columns[n].dtype not in SAFETENSORS_DTYPES for n in names):
            return None
        data_start, header = self.header(i)
        return path, {n: data_start + header[n]["data_offsets"][0] for n in names}

    def verify(self, workers: int | None = None) -> None:
        """Check every shard's size, checksum, header, identity and columns against the manifest (a
        manifest can vouch for a damaged file); raise StoreError naming each bad shard. Shards are
        checked by `workers` threads at once (default 4 per core: hashing and reading release the GIL)."""
        n = self.num_shards
        workers = max(1, min(workers or 4 * (os.cpu_count() or 1), n))
        step = max(1, min(256, n // (4 * workers)))  # a task is a run of shards: few tasks, even ends
        with ThreadPoolExecutor(workers, thread_name_prefix="hookscope-verify") as pool:
            runs = pool.map(
                lambda a: [self._problem(i) for i in range(a, min(a + step, n))], range(0, n, step)
            )
            problems = [p for run in runs for p in run]
        bad = [f"{entry.file}: {p}" for entry, p in zip(self.manifest.shards, problems, strict=True) if p]
        if bad:
            raise StoreError(
                f"{self.path}: {len(bad)} of {self.num_shards} shards are damaged:\n  "
                + "\n  ".join(bad)
                + "\nRe-run the extraction into a new directory."
            )

    def _problem(self, i: int) -> str | None:
        """What is wrong with shard `i` (size, every byte's checksum, streamed, then its header), or None."""
        entry = self.manifest.shards[i]
        local = self.fs.local(entry.file)
        try:
            if local is not None:  # one open for all of it: 100,000 small shards verify in seconds
                return self._local_problem(local, i)
            size = self.fs.size(entry.file)
            if size != entry.bytes:
                return f"{size} bytes, the manifest says {entry.bytes} (truncated or replaced)"
            size, digest = self.fs.checksum(entry.file, entry.algorithm)
            if size != entry.bytes:
                return f"{size} bytes, the manifest says {entry.bytes} (truncated or replaced)"
            if digest != entry.checksum:
                return f"checksum ({entry.algorithm}) differs from the manifest (corrupt)"
            self.header(i, fresh=True)
        except StoreError as e:
            return str(e).removeprefix(f"{self.fs.where(entry.file)}: ")
        return None

    def _local_problem(self, path: Path, i: int) -> str | None:
        entry = self.manifest.shards[i]
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            return "listed in the manifest but missing"
        except OSError as e:
            return f"cannot read it ({e})"
        with f:
            size = os.fstat(f.fileno()).st_size
            if size == entry.bytes:
                size, digest = checksum_of(f, entry.algorithm)
            if size != entry.bytes:
                return f"{size} bytes, the manifest says {entry.bytes} (truncated or replaced)"
            if digest != entry.checksum:
                return f"checksum ({entry.algorithm}) differs from the manifest (corrupt)"
            f.seek(0)
            head = f.read(min(size, HEAD_BYTES))

            def rest(start: int, end: int) -> bytes:
                f.seek(start)
                return f.read(end - start)

            checked_header(
                self.fs.where(entry.file),
                head,
                size,
                entry,
                self.manifest.settings_hash,
                self.manifest.columns,
                rest,
            )
        return None

    def tensor(self, name: str) -> torch.Tensor:
        """Column `name` of every row, in store order, as one in-memory tensor (for small stores)."""
        self.column_names([name])
        if not self.manifest.shards:
            return tensor_of(b"", self.manifest.columns[name], 0)
        if self._ranged is not None:  # only this column's bytes
            return torch.cat([self.load_shard(i, [name])[name] for i in range(self.num_shards)])
        return torch.cat([self.shard(i)[name] for i in range(self.num_shards)])

    def __getitem__(self, row: int) -> dict[str, torch.Tensor]:
        """Every column of one row (map-style access, e.g. for a DataLoader with shuffle=True)."""
        n = len(self)
        if not -n <= row < n:
            raise IndexError(f"row {row} out of range for a store of {n} rows")
        row %= n
        if self._ranged is not None:  # that row's bytes (and the rest of their blocks: readahead)
            return {k: v[0] for k, v in self.rows(row, row + 1).items()}
        i = bisect.bisect_right(self._starts, row) - 1
        return {k: v[row - self._starts[i]] for k, v in self.shard(i).items()}

    def to_numpy(self, name: str) -> np.ndarray:
        """Column `name` as a numpy array; bfloat16 (which numpy lacks) becomes float32."""
        t = self.tensor(name)
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy()

    def dataset(self, point: str | Sequence[str], **options: Any) -> ActivationDataset:
        """A shuffled `IterableDataset` over column(s) `point` (names or globs). `options` are
        `ActivationDataset`'s keywords, the fields of `DatasetOptions`, and it says what each does:
        `shuffle`, `seed`, `buffer_rows`, `split`, `val_fraction`, `rank`, `world_size`, `epoch`,
        `batch_size`, `drop_last`, `repeat` (one `iter()` runs through epoch after epoch, for
        trainers that call `next()`), `prefetch`, `stack` (each pattern's columns as one
        `[batch, layers, ...]` tensor, in block order)."""
        from .dataset import ActivationDataset

        return ActivationDataset(self, point, **options)

    def column_names(self, names: Sequence[str] | None) -> list[str]:
        """`names` (default every column), each checked to be a column of the store."""
        names = list(self.manifest.columns) if names is None else list(names)
        unknown = [n for n in names if n not in self.manifest.columns]
        if unknown:
            raise StoreError(
                f"{self.path}: no column {unknown[0]!r}; the store has {list(self.manifest.columns)}"
            )
        return names
