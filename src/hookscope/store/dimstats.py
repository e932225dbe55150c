"""A store's per-dimension statistics, merged on demand from its shards' headers.

Each shard keeps its points' per-dimension mean and M2 in its own safetensors header (the writer
knows them when it writes the shard); the manifest keeps only the scalar statistics, so its size
and a shard's commit do not grow with the points' width. `StoreStats` (what `store.stats` is)
reads every shard's header once, in parallel (at a URL: ranged reads through the store's
filesystem), checks each field against the shard's manifest entry, and merges them in manifest
order, each group of shards with the pooled formula and the groups with Chan's update (float64,
exact up to its rounding). A store with a shard written before shards kept them gives no
per-dimension statistics (`mean` None), and `missing` says why.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ..errors import StoreError
from .checks import Header
from .manifest import Manifest
from .stats import HEADER_KEY, PointStats, from_header_text

_GROUP = 256  # shards read and merged at a time: bounds the vectors held at once
_READERS = 16  # headers read at once (a URL's round trips overlap)


class StoreStats(Mapping[str, PointStats]):
    """Per point, its `PointStats` over the whole store: the manifest's scalars, and the per-dimension
    mean and M2 merged from every shard's header on the first `[point]` (cached; the scalars alone
    need no read: `store.manifest.stats`). `missing[point]`, when set, says why `mean` is None."""

    def __init__(self, manifest: Manifest, header: Callable[[int], Header], where: Callable[[int], str]):
        self._manifest = manifest
        self._header = header
        self._where = where
        self._merged: dict[str, PointStats] | None = None
        self._missing: dict[str, str] = {}
        self._lock = threading.Lock()

    def __getitem__(self, point: str) -> PointStats:
        if point not in self._manifest.stats:
            raise KeyError(point)
        return self._all()[point]

    def __iter__(self) -> Iterator[str]:
        return iter(self._manifest.stats)

    def __len__(self) -> int:
        return len(self._manifest.stats)

    @property
    def missing(self) -> dict[str, str]:
        """Point -> why its per-dimension statistics are None (reads the headers, as `[point]` does)."""
        self._all()
        return dict(self._missing)

    def _all(self) -> dict[str, PointStats]:
        with self._lock:
            if self._merged is None:
                self._merged = self._merge()
            return self._merged

    def _merge(self) -> dict[str, PointStats]:
        m = self._manifest
        without = [s.file for s in m.shards if s.stats is None]  # format version 1: no stats at all
        totals = {name: st.scalars() for name, st in m.stats.items()}
        if not m.shards or without:
            self._note(totals, without)
            return totals
        widths = {name: math.prod(m.points[name].shape) for name in totals}
        merged = {name: PointStats() for name in totals}
        with ThreadPoolExecutor(_READERS, thread_name_prefix="hookscope-stats") as pool:
            for start in range(0, len(m.shards), _GROUP):
                group = range(start, min(start + _GROUP, len(m.shards)))
                vectors = list(pool.map(lambda i: self._vectors(i, widths), group))
                without += [m.shards[i].file for i, v in zip(group, vectors, strict=True) if v is None]
                if not without:
                    for name in totals:
                        merged[name] = merged[name].merge(
                            _pooled([m.shards[i].stats[name] for i in group], [v[name] for v in vectors])
                        )
        if without:
            self._note(totals, without)
            return totals
        for name, st in merged.items():  # the manifest's scalar sums, in its order; the vectors merged here
            totals[name].mean, totals[name].m2 = st.mean, st.m2
            if st.mean is None:
                self._missing[name] = "no row of it is free of NaN/Inf"
        return totals

    def _vectors(self, i: int, widths: dict[str, int]) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
        """Shard `i`'s per point (mean, M2), read from its header and checked; None if it has none."""
        entry = self._manifest.shards[i]
        text = self._header(i).fields["__metadata__"].get(HEADER_KEY)
        if text is None:
            return None
        counts = {name: st.norm_count for name, st in (entry.stats or {}).items()}
        if set(counts) != set(widths):
            raise StoreError(
                f"{self._where(i)}: its manifest entry has statistics for {sorted(counts)}, the "
                f"store's points are {sorted(widths)}: the manifest is damaged"
            )
        try:
            return from_header_text(text, counts, widths, f"its {HEADER_KEY!r} metadata")
        except (TypeError, ValueError) as e:
            raise StoreError(
                f"{self._where(i)}: {e}: the shard is corrupt or was altered; re-run the "
                "extraction into a new directory"
            ) from None

    def _note(self, totals: dict[str, PointStats], without: list[str]) -> None:
        reason = (
            f"{without[0]}"
            + (f" and {len(without) - 1} other shard(s)" if len(without) > 1 else "")
            + " were written before hookscope kept per-dimension statistics in each shard"
            if without
            else "the store holds no rows"
        )
        self._missing = {name: reason for name in totals}


def _pooled(scalars: list[PointStats], vectors: list[tuple[torch.Tensor, torch.Tensor]]) -> PointStats:
    """The (count, mean, M2) of a group of shards from theirs: count-weighted means, and the M2s
    plus each shard's count times its mean's squared deviation from the pooled mean (no
    cancellation). In numpy: one thread, no pool to wake for a few small sums."""
    counts = np.array([s.norm_count for s in scalars], dtype=np.float64)[:, None]
    n = int(counts.sum())
    if not n:
        return PointStats()
    means = np.stack([mean.numpy() for mean, _ in vectors])
    mean = (counts * means).sum(0) / n
    m2 = np.stack([m2.numpy() for _, m2 in vectors]).sum(0) + (counts * (means - mean) ** 2).sum(0)
    return PointStats(norm_count=n, mean=torch.from_numpy(mean), m2=torch.from_numpy(m2))
