"""The one check a shard passes before its bytes are read, wherever it lives.

A shard is checked before safetensors (or a ranged read) sees it: its size against the manifest,
the 8-byte header length against the size, every tensor's byte range inside the file, the identity
in its metadata against its manifest entry, and each column's dtype, shape and byte length. A
truncated, corrupt, moved or foreign file gives a StoreError naming it, rather than a crash, a
huge allocation or another store's rows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..errors import StoreError
from .manifest import IDENTITY, Column, ShardEntry
from .stats import HEADER_KEY

MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
HEAD_BYTES = 16 << 10  # the first read of a shard: its header is a few KiB, so one read does
# safetensors' dtype codes, by the torch dtype names the manifest uses
SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


class Header(NamedTuple):
    """A shard's checked safetensors header."""

    data_start: int  # the offset of the first data byte
    fields: dict[str, Any]  # the JSON header: each tensor's dtype, shape and data_offsets, `__metadata__`


def check_size(where: str, size: int | None, entry: ShardEntry) -> int:
    """The shard's size, which must be the manifest's."""
    if size is None:
        raise StoreError(f"{where}: listed in the manifest but missing")
    if size != entry.bytes:
        raise StoreError(
            f"{where}: {size} bytes but the manifest says {entry.bytes}: the shard is "
            "truncated or was replaced; re-run the extraction into a new store"
        )
    return size


def checked_header(
    where: str,
    head: bytes,
    size: int,
    entry: ShardEntry,
    settings_hash: str,
    columns: dict[str, Column],
    rest: Callable[[int, int], bytes],
    keep_stats: bool = False,
) -> Header:
    """The header of a shard of `size` bytes from its first bytes `head` (at least `HEAD_BYTES` of
    them; `rest(start, end)` reads more when the header is longer), checked against its manifest
    entry and `columns`. Its per-dimension statistics (`__metadata__[HEADER_KEY]`, checked where
    they are read: store/dimstats.py) are left out unless `keep_stats`: headers kept in memory
    stay small."""
    if size < 8:
        raise StoreError(f"{where}: {size} bytes, too short for a safetensors header: truncated")
    if len(head) < min(size, HEAD_BYTES):
        raise StoreError(
            f"{where}: its first {min(size, HEAD_BYTES)} bytes came back as {len(head)}: "
            "the file is shorter than listed (truncated or replaced); re-open the store"
        )
    n = int.from_bytes(head[:8], "little")
    if n > size - 8 or n > MAX_HEADER:
        raise StoreError(
            f"{where}: header length {n} does not fit in a file of {size} bytes: truncated or corrupt"
        )
    raw = head[8 : 8 + n]
    if len(raw) < n:  # a header longer than the first read: one more for the rest
        more = rest(len(head), 8 + n)
        if len(more) != 8 + n - len(head):
            raise StoreError(
                f"{where}: bytes {len(head)}-{8 + n} came back as {len(more)} bytes: the "
                "file is shorter than listed (truncated or replaced); re-open the store"
            )
        raw += more
    header = _parse(where, raw, size - 8 - n)
    _check_identity(where, header, entry, settings_hash)
    _check_columns(where, header, entry, columns)
    if not keep_stats:
        header["__metadata__"].pop(HEADER_KEY, None)
    return Header(8 + n, header)


def tensor_of(data: bytes, col: Column, rows: int) -> torch.Tensor:
    """A column's rows from their little-endian bytes (safetensors' layout), copied into a tensor."""
    dtype = getattr(torch, col.dtype)
    if not data:
        return torch.empty((rows, *col.shape), dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(rows, *col.shape)


def _parse(where: str, raw: bytes, data: int) -> dict[str, Any]:
    """The header's JSON, every tensor's byte range checked to lie within the `data` bytes after it."""
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # ValueError: bad UTF-8 or JSON, or a 5,000-digit int
        raise StoreError(
            f"{where}: the safetensors header is not valid JSON ({type(e).__name__}): corrupt"
        ) from e
    if not isinstance(header, dict):
        raise StoreError(f"{where}: the safetensors header is not a JSON object: corrupt")
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data
        ):
            raise StoreError(
                f"{where}: tensor {name!r} has byte range {offsets} outside the {data} "
                "data bytes: truncated or corrupt"
            )
    # safetensors lays the tensors end to end over exactly the data bytes (its own loader refuses
    # anything else): an overlap, a gap or bytes after the last tensor mean the file was altered
    end = 0
    for start, stop in sorted(
        info["data_offsets"] for name, info in header.items() if name != "__metadata__"
    ):
        if start != end:
            break
        end = stop
    if end != data:
        raise StoreError(
            f"{where}: the tensors' byte ranges overlap, leave gaps, or stop before the end of "
            f"the {data} data bytes: corrupt"
        )
    return header


def _check_columns(where: str, header: dict[str, Any], entry: ShardEntry, columns: dict[str, Column]) -> None:
    """Each of `columns` is in the header with the manifest's dtype and shape, spanning exactly its
    rows' bytes."""
    for name, col in columns.items():
        info = header.get(name)
        got = (info.get("dtype"), info.get("shape")) if isinstance(info, dict) else None
        # a dtype with no code here (float8, say) is left to safetensors' own loader
        want = (SAFETENSORS_DTYPES.get(col.dtype, got and got[0]), [entry.rows, *col.shape])
        if got != want:
            raise StoreError(
                f"{where}: column {name!r} is {got} in the shard's header, the manifest "
                f"says {want}: corrupt, or from another store"
            )
        start, end = info["data_offsets"]
        if end - start != entry.rows * col.row_bytes:
            raise StoreError(
                f"{where}: column {name!r} spans {end - start} bytes, its {entry.rows} rows "
                f"need {entry.rows * col.row_bytes}: corrupt"
            )


def _check_identity(where: str, header: dict[str, Any], entry: ShardEntry, settings_hash: str) -> None:
    meta = header.get("__metadata__")
    got = meta.get(IDENTITY) if isinstance(meta, dict) else None
    want = entry.identity(settings_hash)
    if got == want:
        return
    if got is None:
        raise StoreError(
            f"{where}: the shard has no {IDENTITY!r} entry in its metadata (it was not written "
            "by a hookscope ShardWriter); re-run the extraction into a new directory"
        )

    def short(identity: str) -> str:  # settings hashes cut to 12 digits
        return re.sub(r"\b([0-9a-f]{12})[0-9a-f]{52}\b", r"\1...", identity)

    raise StoreError(
        f"{where}: the shard holds {short(got)!r}, but the manifest lists it as "
        f"{short(want)!r}: "
        "it was copied from another store or moved within this one; re-run the extraction into "
        "a new directory"
    )
