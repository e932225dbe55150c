"""Per-point statistics a shard carries (`PointStats`), computed for every batch on the extraction's
hot path, so in as few passes over the batch as the values allow: what `hookscope inspect` shows and
what trainers normalise with (SAELens's norm scaling, a cross-layer transcoder's per-dimension
standardisation).

`PointStats.of` takes every row's L2 norm (float32) and the per-dimension sums of the deviations
from a shift near the mean (the mean of the first rows): sums of deviations keep their precision
where the mean is large beside the spread (a plain sum of squares minus the squared sum would
cancel). On the CPU it goes through the batch once, a chunk of rows at a time cast into a reused
`Workspace` and reduced while it is in the cache (the chunks' sums added in float64), on the
calling thread alone (`one_thread`: the forward has the other cores); a row's norm is its own, so
the norms are the same floats as over the whole batch at once. A non-finite value makes its row's
norm non-finite (squares are >= 0, so NaN and Inf survive the sum), so when every norm is finite
every value is; a batch with a non-finite norm is taken again value by value from a float32 copy,
and its rows with a non-finite value are left out of everything but `nonfinite`. The sums become
the batch's (count, mean, M2) in float64, and batches, shards and ranks merge with Chan et al.'s
pairwise update (float64), which is exact up to float64 rounding whatever the order.

The manifest keeps the scalar statistics (`to_json`: a few numbers per point per shard, whatever
the point's width); each shard keeps its own per-dimension mean and M2 in its safetensors header
(`header_text`), and a reader merges them on demand (store/dimstats.py).
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..one_thread import one_thread

_SHIFT_ROWS = 256  # rows whose mean is the shift
_CHUNK_BYTES = 6 << 20  # float32 rows cast and reduced at a time: they stay in the cache
HEADER_KEY = "hookscope.stats"  # the shard's __metadata__ key holding its per-dimension statistics


def count_nonfinite(t: torch.Tensor) -> int:
    """NaN and +-Inf values in `t` (what `PointStats.nonfinite` counts)."""
    return t.numel() - int(torch.isfinite(t).count_nonzero())


@dataclass(eq=False)
class PointStats:
    """Mergeable per-point statistics over the rows that are entirely finite (`norm_count` of them):
    the non-finite values; count / sum / sum of squares of the rows' L2 norms; per dimension of the
    row (flattened), the mean and M2 (the sum of squared deviations from the mean), float64 tensors,
    or None for statistics written before they were kept."""

    nonfinite: int = 0
    norm_count: int = 0
    norm_sum: float = 0.0
    norm_sumsq: float = 0.0
    mean: torch.Tensor | None = None
    m2: torch.Tensor | None = None

    @classmethod
    def of(cls, rows: torch.Tensor, work: Workspace | None = None) -> PointStats:
        """The statistics of `rows` [rows, ...], on any device, any float dtype; `work`: where to
        take the float32 copy (a writer's, reused batch after batch)."""
        flat = rows.reshape(rows.shape[0], -1)
        chunk = (
            None
            if work is None
            else work.take((min(flat.shape[0], _chunk_rows(flat.shape[1])), flat.shape[1]), flat.device)
        )
        if chunk is not None and flat.shape[0]:
            with one_thread():  # the other cores run the forward: splitting each small op costs more
                done = _in_chunks(flat, chunk)
            if done is not None:
                return done
        flat, owned = _float32(flat)
        norms = flat.norm(dim=1)
        if bool(torch.isfinite(norms).all()):
            nonfinite, whole = 0, flat.shape[0]
        else:  # a non-finite norm: a non-finite value, or a finite row whose squares overflow float32
            finite = torch.isfinite(flat)
            nonfinite = flat.numel() - int(finite.count_nonzero())
            whole_rows = finite.all(dim=1)
            norms, whole = norms[whole_rows], int(whole_rows.count_nonzero())
            flat, owned = flat[whole_rows], True
        norms = norms.double()
        if whole:
            shift = flat[:_SHIFT_ROWS].mean(0)
            mean, m2 = _moments(shift, *_deviation_sums(flat, shift, owned), whole)
        else:
            mean, m2 = (torch.zeros(flat.shape[1], dtype=torch.float64) for _ in range(2))
        return cls(nonfinite, whole, float(norms.sum()), float((norms**2).sum()), mean.cpu(), m2.cpu())

    @classmethod
    def of_tensors(cls, scalars: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor) -> PointStats:
        """The statistics `stats_tensors` gave (on the CPU, once the device has computed them)."""
        nonfinite, count, norm_sum, norm_sumsq = scalars.tolist()
        if not count:  # no whole row: as `of` gives (the device divided by zero)
            mean, m2 = torch.zeros_like(mean), torch.zeros_like(m2)
        return cls(int(nonfinite), int(count), norm_sum, norm_sumsq, mean, m2)

    def merge(self, other: PointStats) -> PointStats:
        n = self.norm_count + other.norm_count
        mean = m2 = None
        if not other.norm_count or not self.norm_count:  # the per-dimension side of the one with rows
            mine = self.norm_count or other.mean is None
            mean, m2 = (self.mean, self.m2) if mine else (other.mean, other.m2)
        elif self.mean is not None and other.mean is not None:  # Chan et al.
            delta = other.mean - self.mean
            mean = self.mean + delta * (other.norm_count / n)
            m2 = self.m2 + other.m2 + delta**2 * (self.norm_count * other.norm_count / n)
        return PointStats(
            self.nonfinite + other.nonfinite,
            n,
            self.norm_sum + other.norm_sum,
            self.norm_sumsq + other.norm_sumsq,
            mean,
            m2,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PointStats):
            return NotImplemented
        return (
            (self.nonfinite, self.norm_count, self.norm_sum, self.norm_sumsq)
            == (other.nonfinite, other.norm_count, other.norm_sum, other.norm_sumsq)
            and _same(self.mean, other.mean)
            and _same(self.m2, other.m2)
        )

    def scalars(self) -> PointStats:
        """These statistics without the per-dimension mean and M2: what the manifest keeps."""
        return PointStats(self.nonfinite, self.norm_count, self.norm_sum, self.norm_sumsq)

    def to_json(self) -> dict[str, Any]:
        """The scalar statistics, as the manifest keeps them (its entries, totals and journal lines:
        a few numbers whatever the point's width). The per-dimension mean and M2 live in each
        shard's own header (`header_text`)."""
        return {
            "nonfinite": self.nonfinite,
            "norm_count": self.norm_count,
            "norm_sum": self.norm_sum,
            "norm_sumsq": self.norm_sumsq,
        }

    @classmethod
    def from_json(cls, raw: Any, where: str) -> PointStats:
        """The scalar statistics, checked field by field (TypeError / ValueError naming `where`)."""
        if not isinstance(raw, dict):
            raise TypeError(f"{where} should be dict, got {type(raw).__name__}")
        for k in ("nonfinite", "norm_count"):
            if not isinstance(raw[k], int) or isinstance(raw[k], bool) or raw[k] < 0:
                raise TypeError(f"{where}.{k} should be an int >= 0")
        for k in ("norm_sum", "norm_sumsq"):
            if not isinstance(raw[k], int | float) or isinstance(raw[k], bool):
                raise TypeError(f"{where}.{k} should be a number")
        return cls(raw["nonfinite"], raw["norm_count"], float(raw["norm_sum"]), float(raw["norm_sumsq"]))

    @property
    def norm_mean(self) -> float:
        """The mean row L2 norm (SAELens scales by sqrt(d) / this)."""
        return self.norm_sum / self.norm_count if self.norm_count else math.nan

    @property
    def norm_std(self) -> float:
        if not self.norm_count:
            return math.nan
        return math.sqrt(max(self.norm_sumsq / self.norm_count - self.norm_mean**2, 0.0))

    @property
    def mean_squared_norm(self) -> float:
        """The mean of the rows' squared L2 norms."""
        return self.norm_sumsq / self.norm_count if self.norm_count else math.nan

    @property
    def var(self) -> torch.Tensor | None:
        """Per-dimension variance (population: M2 / rows), float64; None if not kept."""
        return None if self.m2 is None or not self.norm_count else self.m2 / self.norm_count

    @property
    def std(self) -> torch.Tensor | None:
        var = self.var
        return None if var is None else var.sqrt()


class Workspace:
    """The float32 memory `PointStats.of` works in on the CPU, kept from batch to batch: one chunk of
    rows (`_CHUNK_BYTES`), cast and reduced while it is in the cache. A fresh copy per batch would
    fault its pages in every time, which on a CPU costs more than the arithmetic."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0)

    def take(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
        """A float32 tensor of `shape` in this memory; None off the CPU (a device's own allocator
        reuses its memory)."""
        if device.type != "cpu":
            return None
        numel = math.prod(shape)
        if self.buffer.numel() < numel:
            self.buffer = torch.empty(0)  # the old one freed before the new one is made
            self.buffer = torch.empty(numel + numel // 8)
        return self.buffer[:numel].view(shape)


def _chunk_rows(width: int) -> int:
    return max(1, _CHUNK_BYTES // (4 * max(width, 1)))


def _in_chunks(flat: torch.Tensor, chunk: torch.Tensor) -> PointStats | None:
    """`PointStats.of` of the CPU rows `flat` [rows, features], every value finite, in one pass over
    them: each chunk of rows cast into `chunk` (float32, reused) and reduced while it is in the
    cache; the per-dimension sums of each chunk's deviations from the shift added up in float64.
    The norms are the same floats as over the whole batch at once (a row's norm is its own). None
    when a row's norm is not finite: the caller takes the batch value by value."""
    n = flat.shape[0]
    step = chunk.shape[0]
    shift = flat[:_SHIFT_ROWS].float().mean(0)  # the values of the first rows, as `of` takes them
    norms = torch.empty(n)
    s1 = torch.zeros(flat.shape[1], dtype=torch.float64)
    s2 = torch.zeros(flat.shape[1], dtype=torch.float64)
    for start in range(0, n, step):
        part = chunk[: min(step, n - start)].copy_(
            flat[start : start + step]
        )  # the same rounding as .float()
        row_norms = torch.norm(part, dim=1, out=norms[start : start + part.shape[0]])
        if not bool(torch.isfinite(row_norms).all()):
            return None
        part_s1, part_s2 = _deviation_sums(part, shift, owned=True)
        s1 += part_s1
        s2 += part_s2
    mean, m2 = _moments(shift, s1, s2, n)
    norms64 = norms.double()
    return PointStats(0, n, float(norms64.sum()), float((norms64**2).sum()), mean, m2)


def _float32(rows: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """`rows` as a contiguous float32 [rows, features] tensor, and whether it is a copy of ours to
    overwrite (float64 values may overflow here: they count as non-finite)."""
    flat = rows.reshape(rows.shape[0], -1)
    return flat.float().contiguous(), flat.dtype != torch.float32


def _deviation_sums(
    flat: torch.Tensor, shift: torch.Tensor, owned: bool, dropped: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per column of `flat` (overwritten when `owned`), the float64 sums of the deviations from
    `shift` and of their squares, over the rows not `dropped` (a bool [rows] mask)."""
    deviations = flat.sub_(shift) if owned else flat - shift
    if dropped is not None:
        deviations.masked_fill_(dropped[:, None], 0)
    s1 = deviations.sum(0).double()
    return s1, deviations.square_().sum(0).double()


def _moments(
    shift: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor, n: int | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 mean and M2 of `n` rows whose deviations from `shift` sum to `s1`, squared `s2`."""
    return shift.double() + s1 / n, (s2 - s1**2 / n).clamp_(min=0)


def stats_tensors(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`PointStats.of(rows)` as tensors on `rows`' device, computed without the host waiting for it
    (no branch on a value): float64 (nonfinite, norm_count, norm_sum, norm_sumsq), and the float64
    per-dimension mean and M2; `PointStats.of_tensors` reads them once on the host. The rows that
    are not whole (a non-finite value) are zeroed out of every sum but `nonfinite`, as `of` leaves
    them out; the shift is the mean of the whole rows among the first ones."""
    flat, owned = _float32(rows)
    finite = torch.isfinite(flat)
    whole = finite.all(dim=1)
    nonfinite = flat.numel() - finite.sum()
    del finite
    n = whole.sum().double()
    norms = torch.where(whole, flat.norm(dim=1), 0).double()
    head, head_whole = flat[:_SHIFT_ROWS], whole[:_SHIFT_ROWS, None]
    shift = torch.where(head_whole, head, 0).sum(0) / head_whole.sum().clamp(min=1)
    mean, m2 = _moments(shift, *_deviation_sums(flat, shift, owned, dropped=~whole), n)
    return torch.stack([nonfinite.double(), n, norms.sum(), (norms**2).sum()]), mean, m2


def header_text(stats: dict[str, PointStats]) -> str:
    """The per-dimension statistics of one shard, as its safetensors `__metadata__[HEADER_KEY]`:
    JSON (sorted keys, so the shard's bytes are the same from run to run) of, per point, the rows
    they cover (`norm_count`) and the float64 `mean` and `m2` as base64 of their little-endian bytes
    (exact, and 2.7x shorter than JSON numbers)."""
    return json.dumps(
        {
            name: {"norm_count": s.norm_count, "mean": _vector_text(s.mean), "m2": _vector_text(s.m2)}
            for name, s in stats.items()
            if s.mean is not None and s.m2 is not None
        },
        sort_keys=True,
        separators=(",", ":"),
    )


def stats_header_bytes(points: Mapping[str, Any]) -> int:
    """About how long `header_text` is for `points` (name -> a Column): a first read that long
    holds a shard's whole header."""
    return sum(len(name) + 64 + 2 * 4 * math.ceil(8 * math.prod(c.shape) / 3) for name, c in points.items())


def from_header_text(
    raw: Any, counts: dict[str, int], widths: dict[str, int], where: str
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each point's (mean, M2) from a shard's `HEADER_KEY` text, every field checked against the
    shard's manifest entry (`counts`: its rows per point) and the points' `widths` (ValueError)."""
    if not isinstance(raw, str):
        raise ValueError(f"{where} should be a string, got {type(raw).__name__}")
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{where} is not valid JSON ({type(e).__name__})") from None
    if not isinstance(parsed, dict) or set(parsed) != set(counts):
        got = sorted(parsed) if isinstance(parsed, dict) else type(parsed).__name__
        raise ValueError(f"{where} holds {got}, the manifest lists the points {sorted(counts)}")
    out = {}
    for name, st in parsed.items():
        at = f"{where}[{name!r}]"
        count = st.get("norm_count") if isinstance(st, dict) else None
        if type(count) is not int or count != counts[name]:
            raise ValueError(f"{at} does not cover the {counts[name]} rows its manifest entry counts")
        mean, m2 = _vector(st.get("mean"), f"{at}.mean"), _vector(st.get("m2"), f"{at}.m2")
        for label, v in (("mean", mean), ("m2", m2)):
            if len(v) != widths[name]:
                raise ValueError(f"{at}.{label} holds {len(v)} dimensions, the point has {widths[name]}")
        if bool((m2 < 0).any()):
            raise ValueError(f"{at}.m2 holds a negative sum of squares")
        out[name] = mean, m2
    return out


def _vector_text(v: torch.Tensor) -> str:
    return base64.b64encode(v.to(torch.float64).contiguous().numpy().astype("<f8").tobytes()).decode()


def _vector(raw: Any, where: str) -> torch.Tensor:
    if not isinstance(raw, str):
        raise TypeError(f"{where} should be str, got {type(raw).__name__}")
    try:
        data = base64.b64decode(raw.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as e:
        raise ValueError(f"{where} is not base64 ({e})") from None
    if len(data) % 8:
        raise ValueError(f"{where} holds {len(data)} bytes, not a whole number of float64 values")
    v = torch.from_numpy(np.frombuffer(data, dtype="<f8").astype(np.float64))
    if not bool(torch.isfinite(v).all()):
        raise ValueError(f"{where} holds a non-finite value")
    return v


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and torch.equal(a.view(torch.int64), b.view(torch.int64))
