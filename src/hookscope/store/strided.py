"""Shard files mapped side by side in one range of virtual memory, so that one column's rows from
all of them lie at a single stride: one tensor over many shards, gathered with one `index_select`
(the same single copy per row as gathering from a tensor in RAM, with nothing to sort by shard).

mmap places a file only at a page boundary, and a column starts wherever the file's safetensors
header happens to end, so each file is mapped at the first free address where its column's first
row falls on the run's stride. That address is 2 MiB aligned when the alignment costs little
address space, so the page cache's 2 MiB folios are mapped with 2 MiB page-table entries (as a
single mapping of the file would be); else 4 KiB aligned. Between files lie a few rows' worth of
unmapped addresses that no index names. A file that no address fits (headers whose lengths differ
by less than the stride's alignment allows) starts a new run, so a window is a few runs at worst.

Linux only; elsewhere `Runs.supported()` is False and the reader maps shards one by one.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
import weakref

import numpy as np
import torch

_PAGE = 4096
_HUGE = 2 << 20
_MAX_SLACK = 64 << 20  # address space one file may skip to land 2 MiB aligned on the stride
# Linux's flags where Python's mmap module names them (MAP_FIXED it does not)
_PROT_NONE, _PROT_READ = 0, mmap.PROT_READ
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED = mmap.MAP_SHARED, mmap.MAP_PRIVATE, 0x10
_MAP_ANONYMOUS, _MAP_NORESERVE = getattr(mmap, "MAP_ANONYMOUS", 0x20), getattr(mmap, "MAP_NORESERVE", 0x4000)
_FAILED = ctypes.c_void_p(-1).value
_INTS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}

_libc = None


def _c():
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.mmap.restype = ctypes.c_void_p
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = libc
    return _libc


class _Run:
    """One reserved address range; files placed in it share a row stride and `tensor` (rows of
    integers of the element size, any dtype's bytes) views every row of the range."""

    def __init__(self, capacity: int, row_shape: tuple[int, ...], element_size: int):
        self.row_shape = row_shape
        self.element_size = element_size
        self.row_bytes = math.prod(row_shape) * element_size
        size = capacity + _HUGE
        raw = _c().mmap(None, size, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if raw in (None, _FAILED):
            raise OSError(ctypes.get_errno(), f"cannot reserve {size} bytes of address space")
        # everything placed in the range goes with it (the views die with this object, see Runs)
        self._release = weakref.finalize(self, _c().munmap, raw, size)
        self.free = -(-raw // _HUGE) * _HUGE  # the next address a file may take
        self.end = raw + size
        self.anchor: int | None = None  # address of row 0
        self.tensor: torch.Tensor | None = None

    def place(self, fd: int, size: int, offset: int) -> int | None:
        """Map the `size`-byte file `fd` whose column starts at byte `offset`: the column's first row
        here, or None when no free address puts it on this run's stride."""
        at = self.free if self.anchor is None else self._slot(offset)
        if at is None or at + size > self.end:
            return None
        got = _c().mmap(at, size, _PROT_READ, _MAP_SHARED | _MAP_FIXED, fd, 0)
        if got != at:
            raise OSError(ctypes.get_errno(), "mmap at a fixed address failed")
        if self.anchor is None:
            self.anchor = at + offset
            rows = (self.end - self.anchor) // self.row_bytes
            words = (ctypes.c_char * (rows * self.row_bytes)).from_address(self.anchor)
            array = np.frombuffer(words, dtype=_INTS[self.element_size])
            self.tensor = torch.from_numpy(array.reshape(rows, *self.row_shape))
        self.free = -(-(at + size) // _PAGE) * _PAGE
        return (at + offset - self.anchor) // self.row_bytes

    def _slot(self, offset: int) -> int | None:
        """The first free address `a`, aligned to 2 MiB (or else to a page), with a + offset on the
        stride: a linear congruence in the number of alignment steps past the free address."""
        assert self.anchor is not None
        for align in (_HUGE, _PAGE):
            g = math.gcd(align, self.row_bytes)
            period = self.row_bytes // g  # steps after which the residue repeats
            if align == _HUGE and align * period > _MAX_SLACK:
                continue
            start = -(-self.free // align) * align
            need = (self.anchor - offset - start) % self.row_bytes  # align * steps must be this, mod stride
            if need % g:
                continue  # no address with this alignment lands on the stride
            steps = need // g * pow(align // g, -1, period) % period if period > 1 else 0
            return start + align * steps
        return None


class Runs:
    """One column's files, each placed in the first run that fits it: `add` returns (run, first
    row), and `tensor(run)` holds the file's rows from that first row on. Each run reserves address
    space (not memory) for all `files` files of `file_bytes` bytes in all, with their slack."""

    def __init__(self, file_bytes: int, files: int, row_shape: tuple[int, ...], dtype: torch.dtype):
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.row_shape = row_shape
        row_bytes = math.prod(row_shape) * self.element_size
        slack = _HUGE * (row_bytes // math.gcd(_HUGE, row_bytes))
        if slack > _MAX_SLACK:  # files go page aligned
            slack = _PAGE * (row_bytes // math.gcd(_PAGE, row_bytes))
        self.capacity = file_bytes + files * (slack + _HUGE)
        self.runs: list[_Run] = []

    @staticmethod
    def supported() -> bool:
        return sys.platform.startswith("linux")

    def tensor(self, run: int) -> torch.Tensor:
        t = self.runs[run].tensor
        assert t is not None  # a run is kept only once a file is in it
        return t

    def add(self, path: str | os.PathLike, offset: int) -> tuple[int, int]:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            for j, run in enumerate(self.runs):
                first = run.place(fd, size, offset)
                if first is not None:
                    return j, first
            run = _Run(self.capacity, self.row_shape, self.element_size)
            first = run.place(fd, size, offset)
            if first is None:
                raise OSError(f"{path}: {size} bytes do not fit the {self.capacity} reserved")
            self.runs.append(run)
            return len(self.runs) - 1, first
        finally:
            os.close(fd)  # the mapping keeps the file open
