"""Per-point statistics a shard carries (`PointStats`), computed on the writer thread for every
batch, so they are computed in as few passes over the batch as the values allow.

`PointStats.of` first takes every row's L2 norm (float32, one row at a time: a row's norm does not
depend on the other rows). A non-finite value makes its row's norm non-finite (squares are >= 0, so
NaN and Inf survive the sum), so when every norm is finite every value is, and there is nothing
else to do: the common case reads the batch twice (the float32 copy, the norms). Only a batch with
a non-finite norm is checked value by value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def count_nonfinite(t: torch.Tensor) -> int:
    """NaN and +-Inf values in `t` (what `PointStats.nonfinite` counts)."""
    return t.numel() - int(torch.isfinite(t).count_nonzero())


@dataclass
class PointStats:
    """Mergeable per-point statistics: non-finite values, and count / sum / sum of squares of row L2
    norms over the rows that are entirely finite."""

    nonfinite: int = 0
    norm_count: int = 0
    norm_sum: float = 0.0
    norm_sumsq: float = 0.0

    @classmethod
    def of(cls, rows: torch.Tensor) -> PointStats:
        """The statistics of `rows` [rows, ...]."""
        flat = rows.reshape(rows.shape[0], -1).float().contiguous()  # float64 values may overflow here
        norms = flat.norm(dim=1)
        if bool(torch.isfinite(norms).all()):
            nonfinite, whole = 0, flat.shape[0]
        else:  # a non-finite norm: a non-finite value, or a finite row whose squares overflow float32
            finite = torch.isfinite(flat)
            nonfinite = flat.numel() - int(finite.count_nonzero())
            whole_rows = finite.all(dim=1)
            norms, whole = norms[whole_rows], int(whole_rows.count_nonzero())
        norms = norms.double()
        return cls(nonfinite, whole, float(norms.sum()), float((norms**2).sum()))

    def merge(self, other: PointStats) -> PointStats:
        return PointStats(self.nonfinite + other.nonfinite, self.norm_count + other.norm_count,
                          self.norm_sum + other.norm_sum, self.norm_sumsq + other.norm_sumsq)

    @property
    def norm_mean(self) -> float:
        return self.norm_sum / self.norm_count if self.norm_count else math.nan

    @property
    def norm_std(self) -> float:
        if not self.norm_count:
            return math.nan
        return math.sqrt(max(self.norm_sumsq / self.norm_count - self.norm_mean**2, 0.0))
