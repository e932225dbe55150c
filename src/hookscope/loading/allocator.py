"""Freed memory handed back to the system while block streaming runs (`returning_freed_memory`).

A block's pass allocates and frees tensors of a few MB (activations, attention, MLP products).
glibc's malloc serves such sizes from its heap once a larger chunk has been freed (its mmap
threshold slides up to 32 MB), and keeps what is freed there: measured on the bench_big Llama
shape, 25-50 MB of freed heap beside the live tensors at the peak of a `--max-memory` run. With a
fixed threshold every allocation of 256 KiB or more gets its own mapping, unmapped when freed, so
the resident set follows the live tensors; `give_back_freed` after each pass returns the rest (the
smaller tensors' pages, and free heap left by earlier work, e.g. 260 MB after transformers' imports
in some runs, which a pass would otherwise fill and keep: 560 or 610 MB peaks from one run to the
next without it). Elsewhere (not glibc) nothing is changed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
from collections.abc import Iterator

_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
_STREAMING_THRESHOLD = 256 * 2**10
_GLIBC_DEFAULT_THRESHOLD = 128 * 2**10


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None
    except OSError:
        return None


def give_back_freed() -> None:
    """Hand the heap's free pages back to the system (`malloc_trim`): the small tensors a pass freed,
    and the free space earlier work left in the heap, which a pass would otherwise fill and keep."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@contextlib.contextmanager
def returning_freed_memory() -> Iterator[None]:
    """While inside: allocations of 256 KiB or more are mapped on their own and unmapped when freed.
    After: the threshold is glibc's default again (128 KiB, fixed: glibc has no way back to its
    sliding threshold), and the heap's free pages are returned (`malloc_trim`)."""
    libc = _glibc()
    if libc is None:
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, _STREAMING_THRESHOLD)
    give_back_freed()
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, _GLIBC_DEFAULT_THRESHOLD)
        give_back_freed()
