"""What an extraction reports, and the checks every extraction path (text, images) shares.

Its own small room so that `extract.py` can hand an image folder to `images.py` and both can
build the same summary without importing each other.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from .errors import HookscopeError
from .store.manifest import count_nonfinite


@dataclass
class ExtractSummary:
    out: str
    rows: int
    new_rows: int
    batches_done: int
    batches_skipped: int
    seconds: float
    bytes_written: int
    nonfinite: dict[str, int]

    def __str__(self) -> str:
        rate = self.new_rows / self.seconds if self.seconds > 0 else 0.0
        lines = [
            f"wrote {self.new_rows:,} rows in {self.seconds:.1f} s ({rate:,.0f} rows/s, "
            f"{self.bytes_written / 2**20:,.1f} MiB); store holds {self.rows:,} rows -> {self.out}",
        ]
        if self.batches_skipped:
            lines.append(f"resumed: skipped {self.batches_skipped} batches already on disk")
        bad = {k: v for k, v in self.nonfinite.items() if v}
        if bad:
            lines.append("non-finite values (NaN/Inf) per point: "
                         + ", ".join(f"{k}: {v}" for k, v in bad.items()))
        return "\n".join(lines)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


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
