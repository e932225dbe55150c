"""The dataset's reading ahead: window n+1 is read (mapped, its pages brought into memory) on a
thread of its own while window n is consumed, and, when an iterator's epoch ends, the next epoch's
first window, for the next `iter()` (a plain loop over epochs)."""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from .planning import EpochEnd, WindowPlan
from .window import MappedWindow

Load = Callable[[WindowPlan], MappedWindow]


@dataclasses.dataclass(frozen=True)
class Ahead:
    """The next epoch's first window, being read while an iterator's last window was consumed."""

    plan: WindowPlan
    read: Future


class Prefetcher:
    """One reading thread per dataset, kept from iterator to iterator."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0  # the process its thread runs in
        self.ahead: Ahead | None = None

    def windows(
        self,
        plan: Iterator[WindowPlan | EpochEnd],
        load: Load,
        next_epoch: Callable[[int], WindowPlan | None],
    ) -> Iterator[MappedWindow | EpochEnd]:
        """The `plan`'s windows, each made by `load` on the reading thread one window ahead of the
        one handed out; once the plan is spent, the window `next_epoch(e)` plans (e: the epoch after
        the plan's last) is read ahead for the next call."""
        pool = self._pool_here()
        queue: deque[Future | EpochEnd] = deque()

        def pull() -> bool:
            item = next(plan, None)
            if item is None:
                return False
            queue.append(item if isinstance(item, EpochEnd) else self._read(pool, load, item))
            return True

        try:
            more = pull()
            while queue:
                # one window is being read ahead of the one handed out (an epoch's end is no read,
                # so the next epoch's first window is read while this epoch's last is consumed)
                while more and not any(isinstance(item, Future) for item in list(queue)[1:]):
                    more = pull()
                    if not more and isinstance(queue[-1], EpochEnd):  # the next iter()'s first window
                        self._read_ahead(pool, load, next_epoch(queue[-1].epoch + 1))
                item = queue.popleft()
                yield item if isinstance(item, EpochEnd) else item.result()
        finally:
            for item in queue:  # an abandoned iterator stops reading (a read under way ends)
                if isinstance(item, Future):
                    item.cancel()

    def _pool_here(self) -> ThreadPoolExecutor:
        """The reading thread: a forked DataLoader worker inherits the executor and what it was
        reading but not its thread, so it starts its own."""
        if self._pool is None or self._pid != os.getpid():
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="hookscope-prefetch")
            self._pid = os.getpid()
            self.ahead = None
            weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
        return self._pool

    def _read(self, pool: ThreadPoolExecutor, load: Load, window: WindowPlan) -> Future:
        ahead = self.ahead
        self.ahead = None
        if ahead is not None and ahead.plan == window:  # read ahead by the previous iterator
            return ahead.read
        return pool.submit(load, window)

    def _read_ahead(self, pool: ThreadPoolExecutor, load: Load, window: WindowPlan | None) -> None:
        if window is not None:
            self.ahead = Ahead(window, pool.submit(load, window))
