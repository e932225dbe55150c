"""`SharedChange`: a process-wide setting changed while any of several blocks runs.

glibc's malloc thresholds, PyTorch's pinned allocator and Python's garbage collector each have one
setting for the whole process, while the blocks that want it changed nest (a load inside an
extraction) and run in several threads at once (two extractions). One count per setting: the first
block in makes the change and keeps what it found, the last one out puts that back, and the blocks
between them neither change nor restore anything.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class SharedChange(Generic[T]):
    """`change()` makes the change and returns what `restore` needs to undo it, or None where it
    declines (the user chose the setting, the platform has none): that block runs without the
    change, and the next block to enter asks again."""

    def __init__(self, change: Callable[[], T | None], restore: Callable[[T], None]) -> None:
        self._change, self._restore = change, restore
        self._lock = threading.Lock()
        self._holders = 0  # blocks inside now, in any thread
        self._found: T | None = None  # what the first of them found, for the last to put back

    @contextlib.contextmanager
    def held(self) -> Iterator[bool]:
        """Inside: the change holds, where it was made. Yields whether it was."""
        with self._lock:
            if self._holders == 0:
                self._found = self._change()
            on = self._found is not None
            self._holders += on
        try:
            yield on
        finally:
            if on:
                with self._lock:
                    self._holders -= 1
                    if self._holders == 0:
                        found, self._found = self._found, None
                        self._restore(found)
