"""How an extraction ends: with its summary (`ExtractSummary`), interrupted by a signal
(`ExtractInterrupted`, `signals_interrupt`), or refusing a batch whose values are not finite
(`check_finite`, the check every batch of every source passes)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import HookscopeError
from ..store.stats import count_nonfinite


@dataclass
class ExtractSummary:
    """What `hs.extract` returns: `rows` in the store, `new_rows` this run wrote, `batches_done` /
    `batches_skipped` (already on disk: a resume), `seconds`, `bytes_written`, and `nonfinite`
    values per point. `str()` of it is the line `hookscope extract` prints."""

    out: str
    rows: int
    new_rows: int
    batches_done: int
    batches_skipped: int
    seconds: float
    bytes_written: int
    nonfinite: dict[str, int]
    busy: dict[str, float] = field(default_factory=dict)  # each stage's busy share (extract/stages.py)
    bound: str = ""  # the stage that set the pace, in words
    # False on a tensor-parallel group's other ranks (`--tp`): they compute, their group's first writes
    wrote: bool = True

    def __str__(self) -> str:
        if not self.wrote:
            return (
                f"ran {self.batches_done} batches with its tensor-parallel group; its first rank wrote them"
            )
        rate = self.new_rows / self.seconds if self.seconds > 0 else 0.0
        mb_s = self.bytes_written / self.seconds / 1e6 if self.seconds > 0 else 0.0
        lines = [
            f"wrote {self.new_rows:,} rows in {self.seconds:.1f} s ({rate:,.0f} rows/s, {mb_s:,.0f} MB/s, "
            f"{self.bytes_written / 2**20:,.1f} MiB); store holds {self.rows:,} rows -> {self.out}",
        ]
        if self.busy:
            lines.append(
                "busy: "
                + ", ".join(f"{k} {100 * v:.0f}%" for k, v in self.busy.items())
                + (f"; {self.bound}" if self.bound else "")
            )
        if self.batches_skipped:
            lines.append(f"resumed: skipped {self.batches_skipped} batches already on disk")
        bad = {k: v for k, v in self.nonfinite.items() if v}
        if bad:
            lines.append(
                "non-finite values (NaN/Inf) per point: " + ", ".join(f"{k}: {v}" for k, v in bad.items())
            )
        return "\n".join(lines)


class ExtractInterrupted(KeyboardInterrupt):
    """SIGINT / SIGTERM stopped an extraction cleanly: whole shards are committed, nothing else is
    kept, and the same command resumes to a store byte-identical to an uninterrupted run's."""

    def __init__(self, rows: int, out: str):
        super().__init__(rows, out)
        self.rows, self.out = rows, out

    def __str__(self) -> str:
        return f"interrupted after {self.rows:,} rows; run the same command to resume"


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGTERM (a scheduler's preemption, torchrun stopping its workers) stops the run as Ctrl-C
    does. Only the main thread may set signal handlers; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def check_finite(acts: dict[str, torch.Tensor], policy: str, index: int) -> None:
    if policy != "error":
        return  # the writer counts them per point; the summary reports them
    for name, act in acts.items():
        bad = count_nonfinite(act)
        if bad:
            raise HookscopeError(
                f"batch {index}: {bad} non-finite values (NaN/Inf) at {name}; nothing of this batch was "
                "written (earlier batches are safe). Re-run with --on-nonfinite warn to keep them"
            )
