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
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

ALIGN = 64  # bytes: each view starts on a cache line (and suits every dtype's alignment)
SLACK = 8  # a new buffer holds 1/SLACK more than asked: batches vary a little in rows kept


class HostRing:
    """Reused host buffers (`pinned`: page-locked) of at least the bytes asked; `take` hands one
    out, `give_back` returns it. Thread-safe: taken on the main thread, given back by the writer's."""

    def __init__(self, keep: int | None = 8, pinned: bool = True):
        self.keep, self.pinned = keep, pinned
        self.free: list[torch.Tensor] = []
        self.out = 0  # buffers handed out and not given back
        self.most_out = 0  # the most buffers out at once
        self.made = 0  # buffers ever allocated (a flat count in a long run: reuse)
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least `nbytes`, the smallest free one that fits, else a new one."""
        with self.lock:
            fits = [i for i, b in enumerate(self.free) if b.numel() >= nbytes]
            self.out += 1
            self.most_out = max(self.most_out, self.out)
            if fits:  # by index: list.remove would compare tensors by value
                return self.free.pop(min(fits, key=lambda i: self.free[i].numel()))
            self.made += 1
        size = -(-(nbytes + nbytes // SLACK) // 2**20) * 2**20  # whole MiB
        return torch.empty(max(size, ALIGN), dtype=torch.uint8, pin_memory=self.pinned)

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


def views(buffer: torch.Tensor, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `buffer` shaped and typed like `tensors`, one after the other, each aligned."""
    out, at = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        out.append(buffer[at:at + nbytes].view(t.dtype).view(t.shape))
        at += -(-nbytes // ALIGN) * ALIGN
    return out


def nbytes_of(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes `views` lays `tensors` out in."""
    return sum(-(-(t.numel() * t.element_size()) // ALIGN) * ALIGN for t in tensors)
