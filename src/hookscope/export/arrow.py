"""Write a Hugging Face `datasets` folder (what `Dataset.save_to_disk` makes) in one pass.

Each store shard becomes one Arrow IPC stream file, `data-{i:05d}-of-{n:05d}.arrow`, written from
the shard's memory-mapped columns without going through the `datasets` cache: one write, no
second copy. Fixed-shape columns become fixed-size Arrow types (`List(length=d)` for a vector per
row, `Array2D`/`Array3D` for more dimensions), so `datasets` and the trainers that read it see a
shape, not a variable-length list. The folder is built under a temporary name and renamed when
complete: a crash leaves no half-written dataset behind under the requested name.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import StoreError
from ..optional_imports import require

SIDECAR = "hookscope_export.json"  # what the export holds and which store it came from

# torch dtype -> Arrow/`datasets` value type. bfloat16 has no Arrow type: it is widened to float32,
# which holds every bfloat16 value exactly (twice the bytes).
_ARROW_DTYPE = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "float32",
    torch.float64: "float64",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
}


def arrow_dtype(dtype: torch.dtype) -> str:
    if dtype not in _ARROW_DTYPE:
        raise StoreError(f"a column of dtype {dtype} has no Arrow type to export to")
    return _ARROW_DTYPE[dtype]


def import_datasets() -> Any:
    return require(
        "datasets",
        extra="datasets",
        needed_for="exporting to a Hugging Face dataset",
        error=StoreError,
        also=("pyarrow",),
    )  # datasets depends on pyarrow


def feature(shape: tuple[int, ...], dtype: str) -> Any:
    """The `datasets` feature of a per-row shape: a scalar, a fixed-length list, or an ArrayND."""
    datasets = import_datasets()
    if not shape:
        return datasets.Value(dtype)
    if len(shape) == 1:
        return datasets.List(datasets.Value(dtype), length=shape[0])
    if len(shape) > 5:
        raise StoreError(f"a column of per-row shape {shape}: datasets has no array type above 5 dimensions")
    return getattr(datasets, f"Array{len(shape)}D")(shape=tuple(shape), dtype=dtype)


def arrow_column(values: torch.Tensor, feat: Any) -> Any:
    """`values` [rows, *shape] as an Arrow array of type `feat`, built over the tensor's own buffer
    (the only copy is a bfloat16 widening or the file write itself)."""
    import pyarrow as pa

    if values.dtype == torch.bfloat16:
        values = values.float()
    flat = values.contiguous().numpy().reshape(-1)
    rows, shape = values.shape[0], tuple(values.shape[1:])
    array = pa.array(flat)
    if not shape:
        return array
    if len(shape) == 1:
        return pa.FixedSizeListArray.from_arrays(array, shape[0])
    # ArrayND stores nested variable-length lists: offsets every `size` values at each level
    storage = array
    for size, count in zip(reversed(shape), _level_counts(rows, shape), strict=True):
        offsets = pa.array(np.arange(0, count * size + 1, size, dtype=np.int32))
        storage = pa.ListArray.from_arrays(offsets, storage)
    return pa.ExtensionArray.from_storage(feat(), storage)  # the ArrayND feature builds its Arrow type


def _level_counts(rows: int, shape: tuple[int, ...]) -> list[int]:
    """How many lists each nesting level holds, innermost first: rows*a lists of b, then rows of a."""
    counts, total = [], rows * int(np.prod(shape))
    for size in reversed(shape):
        total //= size
        counts.append(total)
    return counts


def write_dataset(
    out: str | os.PathLike,
    features: dict[str, Any],
    tables: Iterator[dict[str, Any]],
    n_files: int,
    *,
    description: str,
    sidecar: dict[str, Any],
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write `n_files` Arrow files, one per item of `tables` (column name -> Arrow array), plus
    `state.json` and `dataset_info.json`, into `out` (built as `out.partial`, renamed at the end)."""
    import pyarrow as pa

    datasets = import_datasets()
    out = Path(out)
    if out.exists():
        if not overwrite:
            raise StoreError(
                f"{out} already exists: choose a new --out directory, or pass overwrite=True "
                "(--overwrite) to replace it"
            )
        if not (out / "state.json").is_file() and any(out.iterdir()):
            raise StoreError(f"{out} exists and is not a dataset folder: refusing to replace it")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    feats = datasets.Features(features)
    schema = feats.arrow_schema
    files, rows = [], 0
    try:
        for i, columns in enumerate(tables):
            name = f"data-{i:05d}-of-{n_files:05d}.arrow"
            table = pa.Table.from_arrays([columns[k] for k in feats], schema=schema)
            with pa.OSFile(str(partial / name), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
                writer.write_table(table)
            files.append({"filename": name})
            rows += table.num_rows
            if progress is not None:
                progress(table.num_rows)
        if len(files) != n_files:
            raise StoreError(f"internal: wrote {len(files)} files, expected {n_files}")
        info = datasets.DatasetInfo(description=description, features=feats)
        info_dict = asdict(info)
        fingerprint = hashlib.sha256(json.dumps(sidecar, sort_keys=True).encode()).hexdigest()[:16]
        state = {
            "_data_files": files,
            "_fingerprint": fingerprint,
            "_format_columns": None,
            "_format_kwargs": {},
            "_format_type": None,
            "_output_all_columns": False,
            "_split": None,
        }
        (partial / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
        (partial / "dataset_info.json").write_text(
            json.dumps({k: info_dict[k] for k in sorted(info_dict)}, indent=2)
        )
        (partial / SIDECAR).write_text(json.dumps({**sidecar, "rows": rows}, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out
