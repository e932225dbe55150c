"""Memory for a dataset's batches: the memory of an earlier batch nothing refers to any more, or
shared memory in a DataLoader worker (store/dataset.py)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
SAME_SIZE_NP = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}  # whole rows of bytes, any dtype


def new_array(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    return np.empty(shape, dtype=dtype)  # numpy asks for transparent huge pages on large arrays


def _refs(kept: list[np.ndarray], i: int) -> int:
    return sys.getrefcount(kept[i])


_UNHELD = _refs([np.empty(1)], 0)  # what _refs counts for an array only the list holds


class Recycler:
    """New batches in memory that a batch let go of earlier, else newly allocated by numpy.

    Faulting a fresh 32 MiB batch in (4,096 x 4,096 float16) costs as much as gathering its rows, and more
    at random in a process's first epochs (bench/RESULTS.md); rewriting memory already faulted in costs
    nothing extra. (A new batch comes from numpy, which asks for transparent huge pages: 16 page faults
    for 32 MiB where torch's allocator takes 8,192.) A buffer is reused only when nothing outside this
    pool refers to it: every tensor, view, `.numpy()` or DLPack capsule of a batch keeps its torch storage
    alive, and the storage holds one reference to the numpy array under it, so an array whose only
    reference is the pool's belongs to no live batch. A batch the consumer keeps is never overwritten; a
    new one is allocated instead. At most `keep` buffers are kept (a dataset keeps four a column), for
    the dataset's life (so each epoch starts on memory already faulted in); a lock keeps two iterators
    on two threads from taking the same one."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self.kept: list[np.ndarray] = []
        self.lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # to a DataLoader worker: an empty pool, no lock
        return {"keep": self.keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["keep"])

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        ints = SAME_SIZE_NP[dtype.itemsize]
        shape = tuple(shape)
        with self.lock:
            unheld = None  # a free buffer of another shape, which a new one may replace
            for i in range(len(self.kept)):  # by index: a loop variable would hold a reference too
                if _refs(self.kept, i) == _UNHELD:
                    if self.kept[i].shape == shape and self.kept[i].dtype == ints:
                        return torch.from_numpy(self.kept[i]).view(dtype)
                    unheld = i
            array = new_array(shape, ints)
            if len(self.kept) < self.keep:
                self.kept.append(array)
            elif unheld is not None:
                self.kept[unheld] = array
            return torch.from_numpy(array).view(dtype)


def empty_shared(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor in shared memory (what a DataLoader worker's batches should be made in: sending
    one then passes a handle instead of copying it into shared memory first)."""
    nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(torch.UntypedStorage._new_shared(nbytes), 0, shape)
