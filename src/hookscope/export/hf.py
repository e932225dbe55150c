"""A store as a Hugging Face `datasets` folder, one example per row (token).

`datasets.load_from_disk(OUT)` memory-maps it. Columns keep their per-row shape as fixed-size Arrow
types and their dtype where Arrow has it; bfloat16 becomes float32 (exact, twice the bytes); the
store's settings travel in the dataset's `info.description` and in `hookscope_export.json`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import StoreError
from .arrow import arrow_column, arrow_dtype, feature, write_dataset
from .progress import rows_progress

if TYPE_CHECKING:  # the store room is below this one; a Store is passed in, never imported
    import datasets

    from ..store import Store


def store_info(store: Store) -> dict[str, Any]:
    """Which store an export came from (its absolute path, or its URL), and the settings that shaped
    its rows."""
    m = store.manifest
    where = store.path if store.fs.remote else os.path.abspath(store.path)
    return {"path": where, "rows": len(store), "settings_hash": m.settings_hash, "settings": m.settings}


def describe(store: Store, layout: str) -> str:
    name = store.path.rstrip("/").rsplit("/", 1)[-1]
    return (
        f"Activations exported by hookscope from the store {name} ({layout}). "
        f"Store settings (JSON): {json.dumps(store.manifest.settings, sort_keys=True)}"
    )


def export_hf(
    store: Store,
    out: str | os.PathLike,
    columns: Sequence[str] | None = None,
    *,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Write column(s) `columns` (default: every column) of `store` as a `datasets` folder with one
    example per row, in store order; one Arrow file per shard, written once. Returns `out`.
    Needs the `datasets` package: `pip install 'hookscope[datasets]'`.

    Returns:
        Path: `out`, a folder `datasets.load_from_disk` opens.

    Raises:
        StoreError: no `datasets` package, an empty store, a column it lacks, or `out` not empty
            without `overwrite=True`."""
    names = store.column_names(columns)
    if not store.num_shards:
        raise StoreError(f"{store.path}: the store holds no rows yet; nothing to export")
    cols = store.manifest.columns
    dtypes = {n: getattr(torch, cols[n].dtype) for n in names}
    features = {n: feature(cols[n].shape, arrow_dtype(dtypes[n])) for n in names}
    sidecar = {
        "format": "hookscope-export",
        "layout": "rows",
        "store": store_info(store),
        "columns": {
            n: {"shape": list(cols[n].shape), "store_dtype": cols[n].dtype, "dtype": arrow_dtype(dtypes[n])}
            for n in names
        },
    }
    with rows_progress(len(store), "export hf", progress) as bar:
        tables = (
            {n: arrow_column(t, features[n]) for n, t in store.load_shard(i, names).items()}
            for i in range(store.num_shards)
        )
        return write_dataset(
            out,
            features,
            tables,
            store.num_shards,
            description=describe(store, "one row per token"),
            sidecar=sidecar,
            overwrite=overwrite,
            progress=bar,
        )


def to_hf_dataset(
    store: Store, columns: Sequence[str] | None = None, *, cache_dir: str | os.PathLike | None = None
) -> datasets.Dataset:
    """A Hugging Face `datasets.Dataset` with one example per row, memory-mapped from a folder
    written once by `export_hf` under `cache_dir` (default: the datasets cache) and reused while the
    store is unchanged. Fixed-shape features; bfloat16 becomes float32."""
    try:
        import datasets
    except ImportError as e:
        raise StoreError(
            "to_hf_dataset needs the `datasets` package: pip install 'hookscope[datasets]'"
        ) from e
    names = store.column_names(columns)
    key = hashlib.sha256(json.dumps([store.manifest.to_json(), names], sort_keys=True).encode()).hexdigest()
    folder = Path(cache_dir or datasets.config.HF_DATASETS_CACHE) / "hookscope" / key[:32]
    if not (folder / "state.json").is_file():
        export_hf(store, folder, names, overwrite=folder.exists(), progress=False)
    return datasets.load_from_disk(str(folder))
