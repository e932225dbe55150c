"""The out stage's host memory: a ring of reused buffers (page-locked for a CUDA copy-out) that the
writer hands back once a batch's bytes are on disk.

A fresh page-locked buffer per batch costs the allocator's call and, in ordinary memory, a page
fault per page on its first write; memory rewritten batch after batch costs neither. Beside
store/recycler.py (a dataset's batches, reused when nothing refers to them any more), a buffer
here is handed back explicitly: the writer says when its bytes are written. A buffer is never
handed out twice; when none is free a new one is made (the writer's bounded queue and its
shard-in-progress bound how many are out at once, so the ring never blocks the forward), and at
most `keep` are kept for reuse (`keep=None`: as many as were ever out at once, so a run that holds
many buffers at a time, one per point of each batch in flight, makes each of them once).

Page-locking is slow (the driver locks every page in memory: gigabytes take seconds), and PyTorch's
pinned allocator rounds each request up to a power of two. So a page-locked buffer is asked for at
exactly that power of two (a batch of 128 MiB gets 128 MiB, not 256 MiB for 128 MiB plus slack),
and a ring with `spare` has one more buffer of the last size made in a background thread while the
ring is still growing: the next batch finds it ready instead of pinning on the main thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import torch

ALIGN = 64  # bytes: each view starts on a cache line (and suits every dtype's alignment)
SLACK = 8  # a new buffer holds 1/SLACK more than asked: batches vary a little in rows kept


def buffer_bytes(nbytes: int, pinned: bool) -> int:
    """The size of a new buffer for `nbytes`: page-locked, the power of two PyTorch's pinned
    allocator rounds to anyway; else 1/SLACK more, in whole MiB."""
    if pinned:
        return max(1 << (max(nbytes, 1) - 1).bit_length(), ALIGN)
    return max(-(-(nbytes + nbytes // SLACK) // 2**20) * 2**20, ALIGN)


class HostRing:
    """Reused host buffers (`pinned`: page-locked) of at least the bytes asked; `take` hands one
    out, `give_back` returns it. Thread-safe: taken on the main thread, given back by the writer's.
    `spare`: while the ring grows, one more buffer is made ahead in a background thread."""

    def __init__(
        self,
        keep: int | None = 8,
        pinned: bool = True,
        spare: bool = False,
        allocate: Callable[[int, bool], torch.Tensor] | None = None,
    ):
        self.keep, self.pinned, self.spare = keep, pinned, spare
        self._allocate = allocate or _allocate
        self.free: list[torch.Tensor] = []
        self.out = 0  # buffers handed out and not given back
        self.most_out = 0  # the most buffers out at once
        self.made = 0  # buffers ever allocated (a flat count in a long run: reuse)
        self.made_ahead = 0  # of them, made by the spare thread
        self.waited = 0.0  # seconds `take` waited for a spare being made
        self.lock = threading.Lock()
        self._making: tuple[threading.Thread, int] | None = None  # the spare in the making, its size

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least `nbytes`, the smallest free one that fits, else a new one."""
        self._await_spare(nbytes)
        with self.lock:
            fits = [i for i, b in enumerate(self.free) if b.numel() >= nbytes]
            self.out += 1
            self.most_out = max(self.most_out, self.out)
            buffer = None
            if fits:  # by index (list.remove would compare tensors by value); of equals, the last
                # given back: its pages are the warmest, and a spare not yet needed stays spare
                buffer = self.free.pop(min(fits, key=lambda i: (self.free[i].numel(), -i)))
            else:
                self.made += 1
        if buffer is None:
            try:
                buffer = self._allocate(buffer_bytes(nbytes, self.pinned), self.pinned)
            except BaseException:
                with self.lock:
                    self.out, self.made = self.out - 1, self.made - 1
                raise
        if self.spare:
            self._make_spare(buffer.numel(), nbytes)
        return buffer

    def _await_spare(self, nbytes: int) -> None:
        """Wait for the spare in the making when it fits and no free buffer does: rather than make
        another one here."""
        making = self._making
        if making is None or making[1] < nbytes or not making[0].is_alive():
            return
        with self.lock:
            if self._free_fits(nbytes):
                return
        started = time.perf_counter()
        making[0].join()
        self.waited += time.perf_counter() - started

    def _make_spare(self, size: int, nbytes: int) -> None:
        """Start making a buffer of `size` in the background when none free fits `nbytes` (the ring
        is growing) and it may hold one more."""
        with self.lock:
            if self._free_fits(nbytes):
                return
            if self.keep is not None and self.made >= self.keep:
                return
            if self._making is not None and self._making[0].is_alive():
                return
            thread = threading.Thread(target=self._make, args=(size,), name="hookscope-pin", daemon=True)
            self._making = (thread, size)
        thread.start()

    def _free_fits(self, nbytes: int) -> bool:
        """Whether a free buffer holds `nbytes` (the caller holds the lock)."""
        return any(b.numel() >= nbytes for b in self.free)

    def _make(self, size: int) -> None:
        try:
            buffer = self._allocate(size, self.pinned)
        except Exception:  # noqa: BLE001 - ahead of need only: a take that needs it allocates (and raises)
            return
        with self.lock:
            if self.keep is None or len(self.free) + self.out < self.keep:
                self.free.insert(0, buffer)  # behind those given back: taken when they are all out
                self.made += 1
                self.made_ahead += 1

    def close(self) -> None:
        """No more spares; wait for the one in the making, so that no thread of ours is inside the
        allocator when the run (or the process) ends."""
        self.spare = False
        making = self._making
        if making is not None:
            making[0].join()

    def forget(self, buffer: torch.Tensor) -> None:
        """`buffer` (from `take`) is not coming back: someone else may still hold it."""
        with self.lock:
            self.out -= 1

    def give_back(self, buffer: torch.Tensor) -> None:
        """`buffer` (from `take`) may be reused: nothing reads or writes it any more."""
        with self.lock:
            self.out -= 1
            self.free.append(buffer)
            keep = self.most_out if self.keep is None else self.keep
            if len(self.free) + self.out > keep and self.free:
                self.free.pop(min(range(len(self.free)), key=lambda i: self.free[i].numel()))  # the smallest


def _allocate(size: int, pinned: bool) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, pin_memory=pinned)


def views(buffer: torch.Tensor, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `buffer` shaped and typed like `tensors`, one after the other, each aligned."""
    out, at = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        out.append(buffer[at : at + nbytes].view(t.dtype).view(t.shape))
        at += -(-nbytes // ALIGN) * ALIGN
    return out


def nbytes_of(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes `views` lays `tensors` out in."""
    return sum(-(-(t.numel() * t.element_size()) // ALIGN) * ALIGN for t in tensors)
