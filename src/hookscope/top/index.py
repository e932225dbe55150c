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
is taken). `fires` counts the rows with a value > 0.

The index file is saved beside the store (`STORE/top/<point>.<neurons|sae-SHA>.safetensors`),
keyed to the store's settings_hash and its shard list (file names and SHA-256s): if the store
changes (a resumed extraction added shards, a shard was replaced), loading it is refused.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import StoreError
from ..store import Store
from .encoders import Encoder, neurons

INDEX_FORMAT = "hookscope-top"
INDEX_VERSION = 1
INDEX_DIR = "top"
DEFAULT_INDEX_K = 32
HIST_BINS = 81
HIST_ZERO = 40  # the bin of |value| < 2^-10
_HIST_LOW_EXP = -10  # log2 of the smallest |value| with a bin of its own


class StaleIndexError(StoreError):
    """A saved index that was built from another version of the store (or another SAE)."""


def hist_edges() -> list[float]:
    """The 82 bin edges of the histogram, -inf and +inf at the ends; the middle bin is (-2^-10, 2^-10)."""
    pos = [(1.5 if j % 2 else 1.0) * 2.0 ** (_HIST_LOW_EXP + j // 2) for j in range(1, 40)]
    return [float("-inf")] + [-v for v in reversed(pos)] + [-(2.0**_HIST_LOW_EXP), 2.0**_HIST_LOW_EXP] \
        + pos + [float("inf")]


def _fold_table() -> torch.Tensor:
    """Maps `(float32 bits >> 22) + 512` (sign, exponent, first mantissa bit: 1024 keys, monotonic in
    the value for each sign) to the 81 bins. 2^-10 has biased exponent 117, i.e. key 234 per sign."""
    mag = torch.arange(512)
    pos = (mag - 234).clamp(min=-1, max=39)  # -1: below 2^-10
    pos_bin = torch.where(pos < 0, HIST_ZERO, HIST_ZERO + 1 + pos)
    neg_bin = torch.where(pos < 0, HIST_ZERO, HIST_ZERO - 1 - pos)
    return torch.cat([neg_bin, pos_bin])  # keys 0..511 are negative floats, 512..1023 positive


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

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tensors = {"values": self.values.contiguous(), "rows": self.rows.contiguous(),
                   "hist": self.hist.contiguous(), "fires": self.fires.contiguous()}
        try:
            save_file(tensors, tmp, metadata={INDEX_FORMAT: json.dumps(self.info, sort_keys=True)})
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def store_key(store: Store) -> dict[str, Any]:
    """What must not change for an index to stay valid: the settings hash and every shard's bytes."""
    m = store.manifest
    return {"settings_hash": m.settings_hash, "shards": [[s.file, s.sha256] for s in m.shards]}


def index_path(store: Store, point: str, encoder: Encoder) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", point)
    return store.path / INDEX_DIR / f"{safe}.{encoder.identity}.safetensors"


def check_point(store: Store, point: str) -> int:
    """The number of raw units of `point` (its per-row shape flattened)."""
    if point not in store.points:
        raise StoreError(f"{store.path}: no point {point!r}; the store has {list(store.points)}")
    units = 1
    for d in store.points[point].shape:
        units *= d
    return units


def build_index(store: Store, point: str, *, encoder: Encoder | None = None, k: int = DEFAULT_INDEX_K,
                batch_rows: int | None = None, progress: bool = False,
                on_batch: Callable[[int], None] | None = None) -> TopIndex:
    """One pass over `store`: the top-k rows, histogram and firing count of every unit of `point`
    (raw units, or the features of `encoder`)."""
    d_in = check_point(store, point)
    encoder = encoder or neurons(d_in)
    if encoder.d_in != d_in:
        raise StoreError(f"the SAE reads {encoder.d_in} inputs but {point!r} has {d_in} values per row "
                         f"(shape {list(store.points[point].shape)}): is it the SAE of another point?")
    if k < 1:
        raise StoreError(f"k={k}: give k >= 1")
    units = encoder.units
    # a batch of unit values is at most ~64 MiB of float32, and at least 1024 rows
    batch_rows = batch_rows or max(1024, min(65536, (1 << 24) // max(units, 1)))
    has_nonfinite = store.stats.get(point) is None or store.stats[point].nonfinite > 0
    top_v = torch.full((units, 0), float("-inf"))
    top_r = torch.zeros((units, 0), dtype=torch.long)
    hist = torch.zeros((units, HIST_BINS), dtype=torch.long)
    fires = torch.zeros(units, dtype=torch.long)
    fold = _fold_table()
    unit_offsets = (torch.arange(units, dtype=torch.int32) * 1024 + 512)
    bar = _progress(progress, len(store), f"top-k index of {point}")
    for i in range(store.num_shards):
        column = store.load_shard(i, [point])[point]
        first = store.first_row(i)
        for start in range(0, column.shape[0], batch_rows):
            x = column[start:start + batch_rows].reshape(-1, d_in).float()
            v = encoder(x)
            if v is x:
                v = v.clone() if has_nonfinite else v
            if has_nonfinite:
                v = torch.nan_to_num_(v, nan=float("-inf"))
            n = v.shape[0]
            # histogram: bincount of (sign, exponent, first mantissa bit) keys, folded to 81 bins
            keys = (v.view(torch.int32) >> 22) + unit_offsets
            counts = torch.bincount(keys.view(-1), minlength=units * 1024).view(units, 1024)
            hist.index_add_(1, fold, counts)
            fires += (v > 0).sum(0)
            bv, br = _batch_topk(v, k)
            top_v, top_r = _merge(top_v, top_r, bv, br + (first + start), k)
            if bar is not None:
                bar.update(n)
            if on_batch is not None:
                on_batch(n)
    if bar is not None:
        bar.close()
    info = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "point": point, "rows": len(store),
            "k": top_v.shape[1], "units": units, "source": encoder.source, **store_key(store)}
    return TopIndex(top_v.contiguous(), top_r.contiguous(), hist, fires, info)


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


def _merge(top_v: torch.Tensor, top_r: torch.Tensor, bv: torch.Tensor, br: torch.Tensor,
           k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two candidate lists per unit; older rows come first, so a stable sort on (value desc)
    keeps equal values in row order once each side is itself in row order among ties."""
    order = torch.argsort(br, dim=1)  # the batch's candidates in row order
    bv, br = torch.gather(bv, 1, order), torch.gather(br, 1, order)
    cv, cr = torch.cat([top_v, bv], 1), torch.cat([top_r, br], 1)
    s = torch.sort(cv, dim=1, descending=True, stable=True).indices[:, :k]
    return torch.gather(cv, 1, s), torch.gather(cr, 1, s)


def load_index(store: Store, point: str, encoder: Encoder, path: str | os.PathLike | None = None) -> TopIndex:
    """The saved index of `point` (and `encoder`), checked against the store as it is now."""
    path = Path(path) if path is not None else index_path(store, point, encoder)
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in ("values", "rows", "hist", "fires")}
    except FileNotFoundError:
        raise
    except (SafetensorError, OSError, KeyError, RuntimeError) as e:
        raise StoreError(f"{path}: not a readable top-k index ({e}); delete it and build it again") from e
    try:
        info = json.loads(meta[INDEX_FORMAT])
    except (KeyError, ValueError) as e:
        raise StoreError(f"{path}: not a hookscope top-k index (no {INDEX_FORMAT!r} metadata)") from e
    if info.get("version") != INDEX_VERSION:
        raise StaleIndexError(f"{path}: index format version {info.get('version')}, this hookscope reads "
                              f"{INDEX_VERSION}; rebuild it (hookscope top ... --rebuild)")
    now = store_key(store)
    problems = []
    if info.get("settings_hash") != now["settings_hash"]:
        problems.append("the store's settings_hash differs")
    if info.get("shards") != now["shards"]:
        old, new = {tuple(s) for s in info.get("shards", [])}, {tuple(s) for s in now["shards"]}
        problems.append(f"the shard list differs ({len(new - old)} shard(s) added or changed, "
                        f"{len(old - new)} gone; {len(now['shards'])} now, "
                        f"{len(info.get('shards', []))} then)")
    if info.get("point") != point or info.get("source") != encoder.source:
        problems.append("it was built for another point or SAE")
    if problems:
        raise StaleIndexError(f"{path}: this top-k index no longer matches the store: {'; '.join(problems)}. "
                              "Rebuild it (hookscope top ... --rebuild, or build_index + save)")
    values = tensors["values"]
    if values.shape[0] != info.get("units") or tensors["rows"].shape != values.shape:
        raise StoreError(f"{path}: index tensors do not match its metadata: the file is damaged; rebuild it")
    return TopIndex(values, tensors["rows"], tensors["hist"], tensors["fires"], info)


def get_index(store: Store, point: str, *, encoder: Encoder | None = None, k: int = DEFAULT_INDEX_K,
              rebuild: bool = False, progress: bool = False, save: bool = True) -> TopIndex:
    """The saved index if there is one and it matches (and keeps at least k per unit); otherwise
    build it (and save it beside the store). A stale index is refused unless `rebuild`."""
    encoder = encoder or neurons(check_point(store, point))
    path = index_path(store, point, encoder)
    if not rebuild and path.is_file():
        index = load_index(store, point, encoder, path)
        if index.k >= min(k, len(store)):
            return index
        raise StoreError(f"{path}: the saved index keeps {index.k} rows per unit, {k} asked; rebuild it with "
                         f"k >= {k} (hookscope top ... --rebuild --k {k})")
    index = build_index(store, point, encoder=encoder, k=k, progress=progress)
    if save:
        try:
            index.save(path)
        except OSError as e:
            raise StoreError(f"cannot save the index to {path} ({e}); "
                             "make the store directory writable") from e
    return index


def _progress(enabled: bool, total: int, desc: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="row", unit_scale=True)
