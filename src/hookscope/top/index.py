"""The top-k index: one pass over a store gives, for every unit of a point (or SAE feature), its k
largest values and their rows, a histogram, and how often it fires.

Memory is bounded by units x (k + bins), never by rows: shards are read one after another
(memory-mapped), a batch of rows at a time, and each batch's per-unit top-k is merged into the
running one.

Order and ties: the top-k of a unit is its k largest values, sorted by value (descending), equal
values ordered by row (ascending): exactly `sorted(range(rows), key=lambda r: (-x[r], r))[:k]`.
NaN counts as -inf (never on top). A unit with fewer than k distinct rows above its ties (a dead
neuron: all zeros) lists its first k rows.

Histogram: 81 bins of |value| on a log scale, two bins per octave ([2^e, 1.5 x 2^e) and
[1.5 x 2^e, 2^(e+1))), per sign: bin 40 holds |value| < 2^-10 (zeros included); bins 41..80 hold
positive values from 2^-10 up (the last one everything from 1.5 x 2^9 = 768), bins 39..0 the
negative values likewise. Computed from the float32 sign, exponent and first mantissa bit (no log
is taken); NaN lands in an outermost bin. `fires` counts the rows with a value >= 2^-15 (> 0 but
for float16's smallest subnormals, so both dtypes count alike).

The index is saved beside the store, or in a local cache when the store is read-only (saved.py),
keyed to the store's settings_hash and its shard list (file names and SHA-256s): if the store
changes (a resumed extraction added shards, a shard was replaced), loading it is refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save

from ..atomic_files import write_atomic
from ..errors import StoreError
from ..progress import RowsBar
from .encoders import Encoder, neurons

if TYPE_CHECKING:  # the store room is below this one; a Store is passed in, never imported
    from ..store import Store

INDEX_FORMAT = "hookscope-top"
INDEX_VERSION = 1
INDEX_DIR = "top"
DEFAULT_INDEX_K = 32
HIST_BINS = 81
HIST_ZERO = 40  # the bin of |value| < 2^-10
_HIST_LOW_EXP = -10  # log2 of the smallest |value| with a bin of its own


def hist_edges() -> list[float]:
    """The 82 bin edges of the histogram, -inf and +inf at the ends; the middle bin is (-2^-10, 2^-10)."""
    pos = [(1.5 if j % 2 else 1.0) * 2.0 ** (_HIST_LOW_EXP + j // 2) for j in range(1, 40)]
    return (
        [float("-inf")]
        + [-v for v in reversed(pos)]
        + [-(2.0**_HIST_LOW_EXP), 2.0**_HIST_LOW_EXP]
        + pos
        + [float("inf")]
    )


def _fold_table(mags: int, low: int) -> torch.Tensor:
    """Maps a key (sign, exponent, first mantissa bit) + mags, monotonic in |value| for each sign, to
    the 81 bins; `low` is the magnitude key of 2^-10. Keys 0..mags-1 are negative values."""
    mag = torch.arange(mags)
    pos = (mag - low).clamp(min=-1, max=39)  # -1: below 2^-10
    pos_bin = torch.where(pos < 0, HIST_ZERO, HIST_ZERO + 1 + pos)
    neg_bin = torch.where(pos < 0, HIST_ZERO, HIST_ZERO - 1 - pos)
    return torch.cat([neg_bin, pos_bin])


class _Binner:
    """Per-unit counts of histogram keys for a batch `[n, units]`: one integer shift and one
    bincount, no logarithm. float32: bits >> 22 (1024 keys); float16: bits >> 9 (128 keys, a table
    8x smaller, so the bincount stays in cache). Both resolve the same 81 bins."""

    def __init__(self, units: int, half: bool):
        self.half = half
        self.dtype, self.shift, self.mags = (torch.int16, 9, 64) if half else (torch.int32, 22, 512)
        # magnitude key of 2^-10 (float16: exponent 5 of bias 15; float32: 117 of 127) and of 2^-15,
        # the smallest value counted as firing in either dtype
        low, fire = (10, 1) if half else (234, 224)
        self.fold = _fold_table(self.mags, low)
        self.fires_from = self.mags + fire
        self.keys = 2 * self.mags
        self.offsets = torch.arange(units, dtype=torch.int32) * self.keys + self.mags
        self._keys: torch.Tensor | None = None

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        n, units = v.shape
        if self._keys is None or self._keys.shape[0] < n:
            # kept from batch to batch: a fresh one would be mapped and faulted in anew every time
            self._keys = torch.empty((n, units), dtype=torch.int32)
        keys = self._keys[:n]
        keys.copy_(v.view(self.dtype))  # the bits, sign-extended to int32 (mixed-type ops are slow)
        keys.bitwise_right_shift_(self.shift)  # arithmetic: negative values keep negative keys
        keys.add_(self.offsets)
        return torch.bincount(keys.view(-1), minlength=units * self.keys).view(units, self.keys)


@dataclass
class TopIndex:
    """Per unit: `values` / `rows` `[units, k]` (best first), `hist` `[units, 81]`, `fires` `[units]`."""

    values: torch.Tensor
    rows: torch.Tensor
    hist: torch.Tensor
    fires: torch.Tensor
    info: dict[str, Any]

    @property
    def k(self) -> int:
        return self.values.shape[1]

    @property
    def units(self) -> int:
        return self.values.shape[0]

    @property
    def total_rows(self) -> int:
        return int(self.info["rows"])

    def frequency(self) -> torch.Tensor:
        """Fraction of rows on which each unit is > 0."""
        return self.fires.double() / max(self.total_rows, 1)

    def to_bytes(self) -> bytes:
        """The index as one safetensors file's bytes (its info in the metadata)."""
        tensors = {
            "values": self.values.contiguous(),
            "rows": self.rows.contiguous(),
            "hist": self.hist.contiguous(),
            "fires": self.fires.contiguous(),
        }
        return save(tensors, metadata={INDEX_FORMAT: json.dumps(self.info, sort_keys=True)})

    def save(self, path: str | os.PathLike) -> None:
        """Write the index to the local file `path` (atomic: a reader sees all of it or none)."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, self.to_bytes())


def store_key(store: Store) -> dict[str, Any]:
    """What must not change for an index to stay valid: the settings hash and every shard's bytes."""
    m = store.manifest
    return {"settings_hash": m.settings_hash, "shards": [[s.file, s.checksum] for s in m.shards]}


def check_point(store: Store, point: str) -> int:
    """The number of raw units of `point` (its per-row shape flattened)."""
    if point not in store.points:
        raise StoreError(f"{store.path}: no point {point!r}; the store has {list(store.points)}")
    units = 1
    for d in store.points[point].shape:
        units *= d
    return units


def build_index(
    store: Store,
    point: str,
    *,
    encoder: Encoder | None = None,
    k: int = DEFAULT_INDEX_K,
    batch_rows: int | None = None,
    progress: bool = False,
    on_batch: Callable[[int], None] | None = None,
) -> TopIndex:
    """One pass over `store`: the top-k rows, histogram and firing count of every unit of `point`
    (raw units, or the features of `encoder`)."""
    d_in = check_point(store, point)
    encoder = encoder or neurons(d_in)
    if encoder.d_in != d_in:
        raise StoreError(
            f"the SAE reads {encoder.d_in} inputs but {point!r} has {d_in} values per row "
            f"(shape {list(store.points[point].shape)}): is it the SAE of another point?"
        )
    if k < 1:
        raise StoreError(f"k={k}: give k >= 1")
    units = encoder.units
    # a batch of unit values is at most ~64 MiB of float32, and at least 1024 rows
    batch_rows = batch_rows or max(1024, min(65536, (1 << 24) // max(units, 1)))
    has_nonfinite = store.manifest.stats.get(point) is None or store.manifest.stats[point].nonfinite > 0
    top_v = torch.full((units, 0), float("-inf"))
    top_r = torch.zeros((units, 0), dtype=torch.long)
    hist = torch.zeros((units, HIST_BINS), dtype=torch.long)
    fires = torch.zeros(units, dtype=torch.long)
    # float16 neurons are binned and compared as stored (a NaN would hide a column's maximum: not then)
    half = encoder.kind == "neurons" and store.points[point].dtype == "float16" and not has_nonfinite
    binner = _Binner(units, half=half)
    mask = torch.empty((batch_rows, units), dtype=torch.bool)
    bar = _progress(progress, len(store), f"top-k index of {point}")
    with ThreadPoolExecutor(1, thread_name_prefix="hookscope-top-hist") as pool:
        for i in range(store.num_shards):
            column = store.load_shard(i, [point])[point]
            first = store.first_row(i)
            for start in range(0, column.shape[0], batch_rows):
                x = column[start : start + batch_rows].reshape(-1, d_in)
                if half:  # exact in float16 (every value is one), and no copy of the batch
                    v = x
                else:
                    v = encoder(x.float())
                    if has_nonfinite:
                        v = torch.nan_to_num(v, nan=float("-inf"))  # a copy: never into the mapped shard
                n = v.shape[0]
                counting = pool.submit(binner, v)  # the bincount runs on one core: overlap it with the top-k
                top_v, top_r = _update(top_v, top_r, v, first + start, k, mask)
                counts = counting.result()
                hist.index_add_(1, binner.fold, counts)
                fires += counts[:, binner.fires_from :].sum(1)
                if bar is not None:
                    bar.update(n)
                if on_batch is not None:
                    on_batch(n)
    if bar is not None:
        bar.close()
    info = {
        "format": INDEX_FORMAT,
        "version": INDEX_VERSION,
        "point": point,
        "rows": len(store),
        "k": top_v.shape[1],
        "units": units,
        "source": encoder.source,
        **store_key(store),
    }
    return TopIndex(top_v.contiguous(), top_r.contiguous(), hist, fires, info)


def _update(
    top_v: torch.Tensor,
    top_r: torch.Tensor,
    v: torch.Tensor,
    offset: int,
    k: int,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge batch `v` `[n, units]` (global rows offset..offset+n) into the running top-k; `mask`
    is a reusable bool buffer of at least v's shape."""
    if top_v.shape[1] == k:
        # Once every unit holds k rows, only values strictly above its k-th can enter: a later row
        # that ties the k-th loses (rows ascending). Usually a handful per batch, so no sort of the
        # batch: the few candidates and the current lists are merged in one small sort. (The k-th
        # values came from v's dtype, so comparing in it is exact; NaN is never above.)
        thr = top_v[:, -1].to(v.dtype)
        active = (v.amax(0) > thr).nonzero().squeeze(1)  # units with any candidate: few, once warm
        if active.shape[0] * 4 < v.shape[1]:
            sub = v[:, active] > thr[active]
            hits = sub.nonzero()
            hits[:, 1] = active[hits[:, 1]]
        else:
            hits = torch.gt(v, thr, out=None if mask is None else mask[: v.shape[0]]).nonzero()
        if hits.shape[0] <= max(4 * top_v.numel(), 1):
            return _merge_sparse(top_v, top_r, v, hits, offset, k)
    if v.dtype != torch.float32:
        v = torch.nan_to_num(v.float(), nan=float("-inf"))
    bv, br = _batch_topk(v, k)
    return _merge(top_v, top_r, bv, br + offset, k)


def _merge_sparse(
    top_v: torch.Tensor, top_r: torch.Tensor, v: torch.Tensor, hits: torch.Tensor, offset: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the batch's (row, unit) `hits` (row-major, as nonzero gives them) into the lists of the
    units they touch, with one stable sort on (unit, value descending). Stability gives the row
    order among equal values: each unit's current list (older rows, itself in row order among
    ties) comes before the hits, which come in row order."""
    if hits.shape[0] == 0:
        return top_v, top_r
    rows, cols = hits[:, 0], hits[:, 1]
    touched = torch.unique(cols)  # sorted
    h = touched.shape[0]
    u = torch.cat([torch.arange(h).repeat_interleave(k), torch.searchsorted(touched, cols)])
    val = torch.cat([top_v[touched].reshape(-1), v[rows, cols].float()]) + 0.0  # -0.0 ties +0.0
    row = torch.cat([top_r[touched].reshape(-1), rows + offset])
    bits = val.view(torch.int32).long()
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # monotonic in the float value
    o = torch.argsort(u * (1 << 32) + ((1 << 31) - 1 - ordered), stable=True)
    u, val, row = u[o], val[o], row[o]
    count = torch.bincount(u, minlength=h)
    start = torch.cumsum(count, 0) - count
    keep = (torch.arange(u.shape[0]) - start[u]) < k  # every touched unit has >= k entries: k kept
    top_v, top_r = top_v.clone(), top_r.clone()
    top_v[touched] = val[keep].view(h, k)
    top_r[touched] = row[keep].view(h, k)
    return top_v, top_r


def _batch_topk(v: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per column of `v` `[n, units]`: the k best (value desc, row asc), as `[units, k]` values and
    rows within the batch."""
    n = v.shape[0]
    kk = min(k, n)
    vals, rows = torch.topk(v, kk, dim=0, sorted=False)  # [kk, units]
    kth = vals.min(0).values
    # topk picks an arbitrary subset of the rows tied at the k-th value; redo those units exactly
    tied = (v >= kth).sum(0) > kk
    vals, rows = vals.T.contiguous(), rows.T.contiguous()
    if bool(tied.any()):
        cols = tied.nonzero().squeeze(1)
        sub, th = v[:, cols], kth[cols]
        above = sub > th
        eq = sub == th
        need = kk - above.sum(0)
        take = above | (eq & (eq.cumsum(0) <= need))
        r = take.T.nonzero()[:, 1].view(len(cols), kk)  # rows ascending within each unit
        vals[cols] = torch.gather(sub.T, 1, r)
        rows[cols] = r
    return vals, rows


def _merge(
    top_v: torch.Tensor, top_r: torch.Tensor, bv: torch.Tensor, br: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two candidate lists per unit; older rows come first, so a stable sort on (value desc)
    keeps equal values in row order once each side is itself in row order among ties."""
    order = torch.argsort(br, dim=1)  # the batch's candidates in row order
    bv, br = torch.gather(bv, 1, order), torch.gather(br, 1, order)
    cv, cr = torch.cat([top_v, bv], 1), torch.cat([top_r, br], 1)
    s = torch.sort(cv, dim=1, descending=True, stable=True).indices[:, :k]
    return torch.gather(cv, 1, s), torch.gather(cr, 1, s)


def _progress(enabled: bool, total: int, desc: str) -> RowsBar | None:
    return RowsBar(desc, total=total) if enabled else None
