"""How the process's host memory is allocated while hookscope runs a model: glibc's malloc set, for
the length of a run, to the policy the run needs; elsewhere (not glibc) nothing is changed.

- `returning_freed_memory`, while blocks stream under `--max-memory` (and while `load(device="meta")`
  builds a model): freed memory leaves the process. A block's pass allocates and frees tensors of a
  few MB (activations, attention, MLP products). glibc's malloc serves such sizes from its heap once
  a larger chunk has been freed (its mmap threshold slides up to 32 MB), and keeps what is freed
  there, beside the live tensors at the peak of a `--max-memory` run (bench/HISTORY.md, Memory,
  "Freed heap beside the live tensors"). With a fixed threshold every allocation of 256 KiB or more gets
  its own mapping, unmapped when freed, so the resident set follows the live tensors;
  `give_back_freed` after each pass returns the rest (the smaller tensors' pages, and free heap left
  by earlier work, e.g. after transformers' imports, which a pass would otherwise fill and keep,
  so that peaks differed from one run to the next without it: bench/HISTORY.md, Memory,
  "`--max-memory` caps the process, second pass").
- `keeping_freed_memory`, while an extraction runs with its whole model in memory: freed memory
  stays for the next batch. Each batch's forward makes tensors of tens of MB (a 32 x 1024 x 768
  float32 embedding output is 100 MB) and frees them; above its mmap threshold (32 MB at most) glibc
  maps each afresh and unmaps it when freed, so every batch's activations were faulted in, zeroed by
  the kernel and unmapped again. With no mappings and the heap's top kept, the next batch reuses the
  last one's pages: an extraction runs faster, for more peak memory (the heap's fragments, not
  growing with the run's length; the figures: bench/HISTORY.md, Memory, "Fifteenth session: the
  heap kept for reuse"). At
  the end `give_back_freed` returns the free heap, all of it where the heap could grow in place (a
  process whose heap had to be continued elsewhere keeps its free top for later allocations).
- `prefer_huge_pages`, for the `hookscope extract` process: PyTorch's own switch to put its large
  tensors on 2 MB pages, so a fresh one faults in 512 times fewer pages.
- `registering_pinned_memory`, while an extraction runs on CUDA and only where asked
  (`HOOKSCOPE_PIN_BY_REGISTER=1`): PyTorch's pinned allocator makes page-locked buffers by faulting
  ordinary memory in and registering it with the driver (its own `pinned_use_cuda_host_register`
  setting) instead of by `cudaHostAlloc`, the slower way to page-lock a buffer in a probe on an
  H100 machine (bench/HISTORY.md, GPU, "The same H100 after the pipe branch" and "The ring pinned
  by registering memory"). Off by default: no extraction on a GPU has run with it yet
  (`scripts/gpu-suite`'s `pin` step measures both ways).

None of them changes a computed or stored bit: page-locked memory is page-locked memory either way.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
from collections.abc import Iterator

import torch

from ..shared_change import SharedChange

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4  # mallopt's parameter numbers (malloc.h)
# glibc's defaults for them (mallopt(3))
_GLIBC_DEFAULT_THRESHOLD = _GLIBC_DEFAULT_TRIM_THRESHOLD = 128 * 2**10
_GLIBC_DEFAULT_MMAP_MAX = 65536
_STREAMING_THRESHOLD = 256 * 2**10
_KEPT_TOP = 2**31 - 1  # bytes of free heap top kept rather than trimmed (mallopt takes an int)
# a user who tunes malloc through the environment keeps their settings while a run keeps its memory
_USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


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


def keeping_freed_memory(enabled: bool = True) -> contextlib.AbstractContextManager[bool]:
    """While inside: nothing is mapped on its own, and freed memory stays in the heap for the next
    allocations (see the module docstring). Yields whether that is so: False when not `enabled`, on a
    C library other than glibc, or when the user set malloc's settings in the environment. After:
    glibc's defaults (a fixed mmap threshold, as `returning_freed_memory` leaves it) and the heap's
    free pages returned."""
    return _HEAP_KEPT.held() if enabled else contextlib.nullcontext(False)


def _keep_freed() -> ctypes.CDLL | None:
    libc = None if _user_tuned() else _glibc()
    if libc is not None:
        libc.mallopt(_M_MMAP_MAX, 0)
        libc.mallopt(_M_TRIM_THRESHOLD, _KEPT_TOP)
    return libc


def _stop_keeping(libc: ctypes.CDLL) -> None:
    libc.mallopt(_M_MMAP_MAX, _GLIBC_DEFAULT_MMAP_MAX)
    libc.mallopt(_M_TRIM_THRESHOLD, _GLIBC_DEFAULT_TRIM_THRESHOLD)
    give_back_freed()


_HEAP_KEPT = SharedChange(_keep_freed, _stop_keeping)


REGISTER_KEY = "pinned_use_cuda_host_register"  # PyTorch's allocator setting (PYTORCH_ALLOC_CONF)
THREADS_KEY = "pinned_num_register_threads"  # threads faulting a new buffer in (a power of two)
REGISTER_ENV = "HOOKSCOPE_PIN_BY_REGISTER"  # "1": pin by registering (off until measured on a GPU)


def registering_pinned_memory(enabled: bool = True) -> contextlib.AbstractContextManager[bool]:
    """While inside: the page-locked buffers PyTorch makes are registered ordinary memory (see the
    module docstring). Yields whether that is so: not where not `enabled`, with
    unless `HOOKSCOPE_PIN_BY_REGISTER=1`, where the user's allocator settings choose either way, on ROCm,
    or where torch cannot read its allocator settings back (before 2.10), so that they could not be
    put back as they were. After: the settings string as it was, put back whole (PyTorch resets some
    keys to their defaults at every change), with registering off again; buffers registered
    meanwhile are unregistered when PyTorch frees them (it records how each was made, since 2.7)."""
    return _REGISTERING.held() if enabled else contextlib.nullcontext(False)


def _start_registering() -> str | None:
    """Registering turned on; the settings string it found (None: left as it is)."""
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    put = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if os.environ.get(REGISTER_ENV, "").strip() != "1" or get is None or put is None or torch.version.hip:
        return None
    try:
        before = get()
        if REGISTER_KEY in before:  # the user's own choice
            return None
        threads = "" if THREADS_KEY in before else f"{THREADS_KEY}:{_register_threads()}"
        put(_joined(before, f"{REGISTER_KEY}:True", threads))
    except (RuntimeError, ValueError):  # refused by this torch's parser: pinned as before
        return None
    return before


def _stop_registering(before: str) -> None:
    torch._C._accelerator_setAllocatorSettings(
        _joined(before, f"{REGISTER_KEY}:False", "" if THREADS_KEY in before else f"{THREADS_KEY}:1")
    )


_REGISTERING = SharedChange(_start_registering, _stop_registering)


def _register_threads() -> int:
    """The largest power of two up to 8 and the CPUs: threads that fault a new buffer's pages in."""
    return 1 << (min(8, os.cpu_count() or 1).bit_length() - 1)


def _joined(*settings: str) -> str:
    return ",".join(s for s in settings if s)


def _user_tuned() -> bool:
    return any(name in os.environ for name in _USER_SETTINGS) or "malloc" in os.environ.get(
        "GLIBC_TUNABLES", ""
    )


def prefer_huge_pages() -> None:
    """Have PyTorch back its large CPU tensors (>= 2 MB) with transparent huge pages, unless the
    user set `THP_MEM_ALLOC_ENABLE` already. On 4 KB pages, faulting a fresh activation in costs
    several times the copy (bench/HISTORY.md, Extraction, "The model stage of a free-forward
    extraction"). PyTorch reads the variable at its first
    large allocation: set after that, it changes nothing. Linux only."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
