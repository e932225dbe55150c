"""What the writer needs of a batch still being copied to the host (extract/copyout.py makes them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from .stats import PointStats


class Handoff(Protocol):
    """`wait()` before its tensors are read (it gives the statistics computed where they were),
    `release()` once they are written; `ready`: nothing to wait for (a CPU capture's buffers)."""

    @property
    def ready(self) -> bool: ...

    def wait(self) -> Mapping[str, PointStats]: ...

    def release(self) -> None: ...
