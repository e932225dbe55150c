"""The out stage: a batch's activations from the device to the host without the main thread waiting.

On a CUDA device each point's statistics are computed where the activations are (`stats_tensors`:
no host sync), and the activations and the statistics are copied into a reused page-locked buffer
of the ring (ring.py), all on a side stream that first waits for the forward; one event per device
marks the end. The main thread goes on to the next batch at once. The writer's thread receives a
`Handoff`: it waits on the events before it reads the buffer (`wait`, which also gives the
statistics), and hands the buffer back once the batch's bytes are on disk (`release`).

On the CPU the capture itself writes each point's kept rows into a buffer of a second ring
(`lend`, asked by the executor's `LendingCapture`, lending.py): the rows are written once, where
the writer reads them, in memory reused batch after batch. Their handoff is `ready` (nothing to
wait for) and has no statistics (the writer measures them on a thread of their own as the batch is
queued); it hands the buffers back once written. Activations on the CPU in memory of their own (a
source that makes its rows itself) go as
they are, with no handoff.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..store.stats import PointStats, stats_tensors
from .ring import HostRing, nbytes_of, views
from .stacking import Groups, Slots


class Handoff:
    """One batch's copy to the host, as the writer sees it: `wait()` (the copy is done: its
    statistics, by point) before reading, `release()` once its bytes are written."""

    def __init__(
        self,
        events: Sequence[Any],
        stats: dict[str, tuple[torch.Tensor, ...]],
        ring: HostRing | None = None,
        buffer: torch.Tensor | None = None,
        sources: Sequence[torch.Tensor] = (),
        on_wait: Callable[[float], None] | None = None,
        lent: Sequence[tuple[HostRing, torch.Tensor]] = (),
    ):
        self.events, self.stats, self.ring, self.buffer = list(events), stats, ring, buffer
        self.on_wait = on_wait  # told the seconds `wait` spent waiting for the device
        self.lent = list(lent)  # (ring, buffer): the host buffers a CPU capture filled
        # the device tensors being read: held until the copy is done, so that the allocator cannot
        # hand their memory to the next forward meanwhile (record_stream would be the other way,
        # but it is an in-place op, refused on a capture's inference tensors)
        self.sources = list(sources)

    @property
    def ready(self) -> bool:
        """Nothing to wait for: the buffers a CPU capture filled."""
        return not self.events

    def wait(self) -> dict[str, PointStats]:
        started = time.perf_counter()
        for event in self.events:
            event.synchronize()
        if self.on_wait is not None:
            self.on_wait(time.perf_counter() - started)
        self.sources = []
        return {name: PointStats.of_tensors(*parts) for name, parts in self.stats.items()}

    def release(self) -> None:
        if self.buffer is not None and self.ring is not None:
            buffer, self.buffer = self.buffer, None  # once only
            self.ring.give_back(buffer)
        lent, self.lent = self.lent, []
        for ring, buffer in lent:
            ring.give_back(buffer)


class CopyOut:
    """The out stage of one run: a side stream per CUDA device, a ring of page-locked buffers for the
    copies from it, and a ring of plain host buffers for CPU captures to write into."""

    def __init__(
        self, keep: int = 8, on_wait: Callable[[float], None] | None = None, groups: Groups | None = None
    ):
        self.ring = HostRing(keep=keep, pinned=True, spare=True)  # pinning is slow: made ahead
        self.host = HostRing(keep=None, pinned=False)  # what CPU captures write into (`lend`)
        # this batch's host buffers out to the capture: (the tensor handed out, its ring buffer)
        self.lent: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.on_wait = on_wait  # each handoff's wait for the device, in seconds (the run's report)
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        # `--stack`: a CPU capture writes each stacked point into its slot of one buffer
        self.slots = Slots(groups, self._lend) if groups else None

    def lend(self, point: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A buffer of the host ring, `shape` and `dtype`, for a capture on the CPU to write `point`'s
        kept rows into (a stacked point's slot of its column's buffer)."""
        slot = None if self.slots is None else self.slots.slot(point, shape, dtype)
        return slot if slot is not None else self._lend(shape, dtype)

    def _lend(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        buffer = self.host.take(nbytes)
        lent = buffer[:nbytes].view(dtype).view(shape)
        self.lent.append((lent, buffer))
        return lent

    def _claim(self, acts: dict[str, torch.Tensor]) -> list[tuple[HostRing, torch.Tensor]]:
        """The lent buffers that `acts` are (the very tensors handed out: a point's rows, or a
        stacked column); any other lent since the last batch is not handed back (a source that
        made its rows from them may hold them still)."""
        held = {id(a) for a in acts.values()}
        claimed = []
        for lent, buffer in self.lent:
            if id(lent) in held:
                claimed.append((self.host, buffer))
            else:
                self.host.forget(buffer)
        self.lent.clear()
        return claimed

    def __call__(self, acts: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Handoff | None]:
        """`acts` on the host (views of a ring buffer for those on CUDA, still being filled), and the
        handoff the writer waits on (None when nothing came from a CUDA device or a lent buffer)."""
        lent = self._claim(acts)
        cuda = {name: a for name, a in acts.items() if a.device.type == "cuda"}
        if not cuda:
            return {name: a.cpu() for name, a in acts.items()}, Handoff([], {}, lent=lent) if lent else None
        buffer = self.ring.take(nbytes_of(cuda.values()))
        placed = dict(zip(cuda, views(buffer, cuda.values()), strict=True))
        sides: dict[torch.device, torch.cuda.Stream] = {}
        stats: dict[str, tuple[torch.Tensor, ...]] = {}
        for name, a in cuda.items():
            side = sides.get(a.device)
            if side is None:
                side = sides[a.device] = self._side(a.device)
                side.wait_stream(torch.cuda.current_stream(a.device))  # after the forward that made them
            with torch.cuda.stream(side):
                parts = stats_tensors(a)
                placed[name].copy_(a, non_blocking=True)
                stats[name] = tuple(_pinned(p).copy_(p, non_blocking=True) for p in parts)
        events = []
        for side in sides.values():
            event = torch.cuda.Event()
            event.record(side)
            events.append(event)
        host = {name: placed[name] if name in placed else a.cpu() for name, a in acts.items()}
        return host, Handoff(
            events, stats, self.ring, buffer, sources=list(cuda.values()), on_wait=self.on_wait, lent=lent
        )

    def close(self) -> None:
        """The run is over: no buffer is made ahead any more (ring.py)."""
        self.ring.close()

    def _side(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]


def _pinned(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
