"""Read a store: memory-mapped shards, checksums on request, tensors, numpy and `datasets` export.

A shard is checked before safetensors sees it (size against the manifest, the 8-byte header length
against the file size, every tensor's byte range inside the file), so a truncated or corrupt file
gives a StoreError naming it rather than a crash or a huge allocation.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from ..errors import StoreError
from .fs import Remote, ShardCache, is_remote, local_path, sha256_of
from .manifest import IDENTITY, MANIFEST, SHARDS_DIR, Column, Manifest, PointStats, ShardEntry

if TYPE_CHECKING:
    import datasets

    from .dataset import ActivationDataset

_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def open_store(path: str | os.PathLike, *, verify: bool = False) -> Store:
    """Open the store at `path` (a directory with manifest.json, or a URL such as s3://bucket/dir:
    see store/fs.py); `verify=True` also checks every shard's size and SHA-256 against the manifest.
    A remote store's shards are copied on first use into a bounded local cache (prefetching the
    next one), so reading works as it does locally."""
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


_UNMERGED = ("{root}: only per-rank manifests here; the torchrun job did not finish. Re-run it (it "
             "resumes), or merge them with hookscope.store.merge_rank_manifests(path, world_size)")


def _open_remote(remote: Remote, verify: bool) -> Store:
    names = remote.list()
    if not names:
        raise StoreError(f"{remote}: no such store (nothing at that URL)")
    if MANIFEST not in names:
        if any(n.startswith("manifest.rank") for n in names):
            raise StoreError(_UNMERGED.format(root=remote))
        raise StoreError(f"{remote}/{MANIFEST}: no manifest here; is this a hookscope store?")
    store = Store(remote.url, Manifest.from_bytes(remote.read(MANIFEST), f"{remote}/{MANIFEST}"), remote)
    present = set(remote.list(SHARDS_DIR))
    missing = [s.file for s in store.manifest.shards if s.file.removeprefix(SHARDS_DIR + "/") not in present]
    if missing:
        raise StoreError(f"{remote}: {len(missing)} shard object(s) listed in the manifest are missing, "
                         f"e.g. {missing[0]}")
    if verify:
        store.verify()
    return store


class Store:
    """A read-only view of a store directory. `len(store)` is the number of rows (tokens)."""

    def __init__(self, path: Path | str, manifest: Manifest, remote: Remote | None = None):
        self.path = path  # a Path, or the URL (a str) of a remote store
        self.manifest = manifest
        self._downloads = ShardCache(remote) if remote else None
        if self._downloads is not None:  # the local copies go when the store does
            weakref.finalize(self, self._downloads.close)
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
        """Every column of shard `i`, memory-mapped (pages are read when touched)."""
        if i not in self._cache:
            self._cache[i] = self.load_shard(i)
        return self._cache[i]

    def load_shard(self, i: int, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Columns `names` (default all) of shard `i`, checked and memory-mapped; not cached."""
        entry = self.manifest.shards[i]
        names = list(self.manifest.columns) if names is None else list(names)
        self._check_names(names)
        if self._downloads is None:
            return self._load_local(self.path / entry.file, entry, names)
        local = self._downloads.get(entry.file)
        if i + 1 < self.num_shards:  # the next shard downloads while this one is used
            self._downloads.prefetch(self.manifest.shards[i + 1].file)
        try:
            return self._load_local(local, entry, names)
        except StoreError as e:  # name the object, not the cache file
            raise StoreError(str(e).replace(str(local), f"{self.path}/{entry.file}")) from e.__cause__

    def _load_local(self, path: Path, entry: ShardEntry, names: list[str]) -> dict[str, torch.Tensor]:
        size = _file_size(path)
        if size != entry.bytes:
            raise StoreError(f"{path}: {size} bytes but the manifest says {entry.bytes}: the shard is "
                             "truncated or was replaced; re-run the extraction into a new directory")
        header = _read_header(path, size)
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
            try:
                local = self._downloads.get(entry.file) if self._downloads else self.path / entry.file
            except StoreError as e:
                bad.append(f"{entry.file}: {str(e).removeprefix(f'{self.path}/{entry.file}: ')}")
                continue
            problem = _check_shard(local, entry)
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

    def tensor(self, name: str) -> torch.Tensor:
        """Column `name` of every row, in store order, as one in-memory tensor (for small stores)."""
        self._check_names([name])
        if not self.manifest.shards:
            col = self.manifest.columns[name]
            return torch.empty((0, *col.shape), dtype=getattr(torch, col.dtype))
        return torch.cat([self.shard(i)[name] for i in range(self.num_shards)])

    def __getitem__(self, row: int) -> dict[str, torch.Tensor]:
        """Every column of one row (map-style access, e.g. for a DataLoader with shuffle=True)."""
        n = len(self)
        if not -n <= row < n:
            raise IndexError(f"row {row} out of range for a store of {n} rows")
        row %= n
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


def _read_header(path: Path, size: int) -> dict[str, Any]:
    """The safetensors JSON header, after checking that it and every tensor's bytes lie in the file."""
    if size < 8:
        raise StoreError(f"{path}: {size} bytes, too short for a safetensors header: truncated")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > size - 8 or n > _MAX_HEADER:
            raise StoreError(f"{path}: header length {n} does not fit in a file of {size} bytes: "
                             "truncated or corrupt")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as e:  # ValueError: bad UTF-8 or JSON, or a 5,000-digit int
            raise StoreError(f"{path}: the safetensors header is not valid JSON ({type(e).__name__}): "
                             "corrupt") from e
    if not isinstance(header, dict):
        raise StoreError(f"{path}: the safetensors header is not a JSON object: corrupt")
    data = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data):
            raise StoreError(f"{path}: tensor {name!r} has byte range {offsets} outside the {data} "
                             "data bytes: truncated or corrupt")
    return header


def _check_identity(path: Path, header: dict[str, Any], entry: ShardEntry, settings_hash: str) -> None:
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
