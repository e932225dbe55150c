"""How an extraction run's host memory is allocated: fresh activations each batch, at the cost of a
copy, not of the kernel's page work.

Each batch's forward makes tensors of tens of MB (a 32 x 1024 x 768 float32 embedding output is
100 MB), frees them, and makes them again for the next batch. Two settings keep that from costing
more than the writes themselves:

- `prefer_huge_pages`: PyTorch backs its large CPU tensors with 2 MB pages, so a fresh one faults
  in 512 times fewer pages.
- `reused_heap`: glibc's malloc serves an allocation above its mmap threshold (32 MB at most) with a
  fresh `mmap` and hands it back with `munmap` when freed, so every batch's activations were
  faulted in, zeroed by the kernel and unmapped again. For the run, malloc takes all memory from its
  heap and keeps the heap's top: the next batch's tensors reuse the last one's pages. On the 2-core
  box, one point's free-forward extraction to /dev/shm ran ~1.55x faster without huge pages and
  ~1.10x with them, for ~100 MB more peak memory, flat over the run's length (bench/HISTORY.md,
  "The heap kept for reuse"). When the run ends glibc's defaults come back and the free heap is
  handed back (`malloc_trim`).

Neither changes a stored bit.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Iterator

# mallopt's parameters and glibc's defaults for them (malloc.h; mallopt(3))
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_DEFAULT_TRIM_THRESHOLD, _DEFAULT_MMAP_MAX = 128 * 1024, 65536
_KEPT_TOP = 2**31 - 1  # bytes of free heap top kept rather than trimmed: mallopt takes an int
# a user who tunes malloc through the environment keeps their settings
_USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

_lock = threading.Lock()
_runs = 0  # runs inside `reused_heap` now: the first sets the settings, the last resets them


def prefer_huge_pages() -> None:
    """Have PyTorch back its large CPU tensors (>= 2 MB) with transparent huge pages, unless the
    user set `THP_MEM_ALLOC_ENABLE` already. On 4 KB pages, faulting a fresh activation in costs
    several times the copy (a fresh 32 x 1024 x 768 float32 -> bfloat16 cast measured 86-114 ms,
    16-38 ms with huge pages, on a loaded 2-core machine). PyTorch reads the variable at its first
    large allocation: set after that, it changes nothing. Linux only."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (the one with `mallopt` and `malloc_trim`)."""
    if any(name in os.environ for name in _USER_SETTINGS) or "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:  # no C library to load (not a POSIX system)
        return None
    if not all(hasattr(libc, f) for f in ("gnu_get_libc_version", "mallopt", "malloc_trim")):
        return None
    return libc


@contextlib.contextmanager
def reused_heap(enabled: bool = True) -> Iterator[bool]:
    """Within the block, large allocations come from malloc's heap and freed memory stays there for
    the next ones (see the module docstring). Yields whether that is so: False when not `enabled`,
    on a C library other than glibc, or when the user set malloc's settings in the environment.
    A run under `--max-memory` passes `enabled=False`: its freed block weights must leave the
    process, not wait in the heap."""
    global _runs
    libc = _glibc() if enabled else None
    if libc is None:
        yield False
        return
    with _lock:
        if _runs == 0:
            libc.mallopt(_M_MMAP_MAX, 0)
            libc.mallopt(_M_TRIM_THRESHOLD, _KEPT_TOP)
        _runs += 1
    try:
        yield True
    finally:
        with _lock:
            _runs -= 1
            if _runs == 0:
                libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
                libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
                libc.malloc_trim(0)
