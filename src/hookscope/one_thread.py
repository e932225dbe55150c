"""`one_thread()`: torch's CPU ops in the calling thread run on that thread alone, for a while.

An extraction on the CPU keeps its cores busy with threads of its own (the forward, the writer, the
data), so an op that splits itself over torch's intra-op threads only adds a fork and a join, and
where torch uses OpenMP its idle threads spin, so that small copies split over them cost many
times their CPU on one thread (bench/HISTORY.md, Writer, "The per-batch CPU of the statistics and
the capture's copy"). OpenMP's thread count
is a setting of each thread (unlike `torch.set_num_threads`, which is the process's), so it is set
here for the calling thread only and put back after. Where torch does not use OpenMP, or its
OpenMP library cannot be found, this does nothing: the ops give the same bits either way.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_omp: ctypes.CDLL | None | bool = False  # not looked up yet
_lock = threading.Lock()


def _openmp() -> ctypes.CDLL | None:
    global _omp
    with _lock:
        if _omp is False:
            _omp = None
            if "OpenMP" in torch.__config__.parallel_info():
                try:
                    lib = ctypes.CDLL(None)  # torch's OpenMP runtime, loaded with it
                    lib.omp_get_max_threads.restype = ctypes.c_int
                    lib.omp_set_num_threads.argtypes = [ctypes.c_int]
                    _omp = lib
                except (OSError, AttributeError, TypeError):  # no such library or symbol here
                    pass
        return _omp


@contextmanager
def one_thread() -> Iterator[None]:
    """Within the block, this thread's CPU ops use no intra-op threads (others' are untouched)."""
    lib = _openmp()
    if lib is None:
        yield
        return
    torch.get_num_threads()  # torch sets each thread's count at its first use: let it do so first
    before = lib.omp_get_max_threads()
    lib.omp_set_num_threads(1)
    try:
        yield
    finally:
        lib.omp_set_num_threads(before)
