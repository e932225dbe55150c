"""A safetensors file's tensors read by their byte ranges: the index of a file's header
(`safetensors_index`), a tensor `pread` straight into a buffer (`read_into`, a dtype conversion
through a small staging buffer), some rows of one (`read_rows`), and a hint to the kernel to read
one ahead (`page_in`).

No memory map and no whole-tensor temporary: what block streaming's reused buffers read through.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorRead:
    """Where one stored tensor's bytes lie in a safetensors file."""

    file: str
    offset: int  # from the file's start
    nbytes: int
    stored: torch.dtype
    shape: tuple[int, ...]


@lru_cache(maxsize=64)
def safetensors_index(file: str) -> dict[str, TensorRead]:
    """A safetensors file's tensors (its header: an 8-byte length, then JSON); a dtype this reader
    does not know is left out (its tensor then loads the ordinary way)."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    start = 8 + length
    return {
        key: TensorRead(
            file,
            start + entry["data_offsets"][0],
            entry["data_offsets"][1] - entry["data_offsets"][0],
            _DTYPES[entry["dtype"]],
            tuple(entry["shape"]),
        )
        for key, entry in header.items()
        if key != "__metadata__" and entry["dtype"] in _DTYPES
    }


def read_into(read: TensorRead, out: Tensor, staging: Tensor) -> None:
    """`read`'s tensor into `out` (contiguous, on the CPU, of its shape), converted to `out`'s dtype
    as `Tensor.to` converts; `staging` is a uint8 buffer for the stored bytes of a conversion."""
    with open(read.file, "rb", buffering=0) as f:
        _read_range(f.fileno(), read.offset, read.stored, out.reshape(-1), staging)


def read_rows(read: TensorRead, rows: list[int], out: Tensor, staging: Tensor) -> None:
    """Rows `rows` (ascending, each in range) of `read`'s tensor into `out` (contiguous, on the CPU,
    one row each), converted as `read_into` converts; each run of consecutive rows is one read."""
    width = math.prod(read.shape[1:])
    row_bytes = width * read.stored.itemsize
    flat = out.reshape(-1)
    with open(read.file, "rb", buffering=0) as f:
        start = 0
        while start < len(rows):
            end = start + 1
            while end < len(rows) and rows[end] == rows[end - 1] + 1:
                end += 1
            _read_range(
                f.fileno(),
                read.offset + rows[start] * row_bytes,
                read.stored,
                flat[start * width : end * width],
                staging,
            )
            start = end


def _read_range(fd: int, offset: int, stored: torch.dtype, flat: Tensor, staging: Tensor) -> None:
    """`flat.numel()` values stored as `stored` from `offset` into `flat`, converted to its dtype."""
    if stored == flat.dtype:
        _pread(fd, flat.view(torch.uint8), offset)
        return
    per_chunk = max(1, staging.numel() // stored.itemsize)
    for start in range(0, flat.numel(), per_chunk):
        n = min(per_chunk, flat.numel() - start)
        raw = staging[: n * stored.itemsize]
        _pread(fd, raw, offset + start * stored.itemsize)
        flat[start : start + n].copy_(raw.view(stored))


def page_in(read: TensorRead) -> None:
    """Have the kernel read `read`'s bytes into the page cache (nothing is copied here)."""
    with open(read.file, "rb", buffering=0) as f:
        os.posix_fadvise(f.fileno(), read.offset, read.nbytes, os.POSIX_FADV_WILLNEED)


def _pread(fd: int, into: Tensor, offset: int) -> None:
    view = memoryview(into.numpy()).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"{offset + done}: the weight file ended early")
        done += n
