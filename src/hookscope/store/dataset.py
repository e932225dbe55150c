"""A shuffled, resumable `IterableDataset` over a store's rows.

An epoch is planned without reading any data: the shards are put in a seeded random order and
grouped into windows of at least `buffer_rows` rows; each window's rows (several shards
interleaved) are loaded and yielded in a seeded random permutation. Position p of the epoch's
stream goes to rank p % world_size. Everything is a pure function of (seed, epoch) and the store,
so the sampler's state is just (epoch, rows yielded): restoring it skips whole windows without
reading them and yields exactly the remaining rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..errors import StoreError

if TYPE_CHECKING:
    from .reader import Store

_CHUNK = 4096  # rows gathered at once from a loaded window


class ActivationDataset(IterableDataset):
    """Rows of column(s) `point` (a tensor per row, or a dict of them when `point` is a list);
    with `batch_size`, stacked batches instead.

    `split="train"` / `"val"` keeps the rows whose hashed global index falls above / below
    `val_fraction` (fixed per row, independent of the seed). `rank` / `world_size` give each
    data-parallel process a disjoint share; together they cover every row once per epoch. After
    an epoch is exhausted the dataset moves to the next epoch (a new order). `state_dict()` is the
    cursor; with a DataLoader worker the copy in the worker advances, not this one, so build the
    state from the rows you consumed: `load_state_dict({"epoch": e, "position": rows_seen, ...})`.
    """

    def __init__(self, store: Store, point: str | Sequence[str], *, shuffle: bool = True, seed: int = 0,
                 buffer_rows: int = 1 << 18, split: str | None = None, val_fraction: float = 0.1,
                 rank: int = 0, world_size: int = 1, epoch: int = 0, batch_size: int | None = None,
                 drop_last: bool = False):
        super().__init__()
        self.names = [point] if isinstance(point, str) else list(point)
        store._check_names(self.names)
        if split not in (None, "train", "val"):
            raise StoreError(f"split={split!r}: use None, 'train' or 'val'")
        if split is not None and not 0.0 < val_fraction < 1.0:
            raise StoreError(f"val_fraction={val_fraction} must be between 0 and 1")
        if not 0 <= rank < world_size:
            raise StoreError(f"rank {rank} is outside world_size {world_size}")
        if buffer_rows < 1 or (batch_size is not None and batch_size < 1):
            raise StoreError("buffer_rows and batch_size must be >= 1")
        if seed < 0 or epoch < 0:
            raise StoreError(f"seed ({seed}) and epoch ({epoch}) must be >= 0")
        self.store, self.single = store, isinstance(point, str)
        self.shuffle, self.seed, self.buffer_rows = shuffle, seed, buffer_rows
        self.split, self.val_fraction = split, val_fraction
        self.rank, self.world_size = rank, world_size
        self.batch_size, self.drop_last = batch_size, drop_last
        self.epoch, self.position = epoch, 0
        self._kept = [int(self._keep_mask(i).sum()) if split else s.rows
                      for i, s in enumerate(store.manifest.shards)]

    # -- the cursor -------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        if epoch < 0:
            raise StoreError(f"epoch ({epoch}) must be >= 0")
        self.epoch, self.position = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "split": self.split, "rows": self.rows_per_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "rank", "world_size", "split"):
            if key in state and state[key] != getattr(self, key):
                raise StoreError(f"sampler state has {key}={state[key]!r} but this dataset has "
                                 f"{getattr(self, key)!r}; build the dataset with the same arguments")
        if "rows" in state and state["rows"] != self.rows_per_epoch:
            raise StoreError(f"sampler state was saved over {state['rows']} rows per epoch, this dataset has "
                             f"{self.rows_per_epoch}: a different store or split")
        if not 0 <= state["position"] <= self.rows_per_epoch:
            raise StoreError(f"sampler position {state['position']} is outside 0..{self.rows_per_epoch}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    # -- sizes ------------------------------------------------------------------------------------

    @property
    def rows_per_epoch(self) -> int:
        """Rows this rank yields per epoch."""
        return self._mine(0, sum(self._kept))

    def __len__(self) -> int:
        rows = self.rows_per_epoch
        if self.batch_size is None:
            return rows
        return rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)

    # -- iteration --------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            raise StoreError("an ActivationDataset splits work by rank, not by DataLoader worker: use "
                             "num_workers=0 or 1 (reads are memory-mapped and cheap)")
        epoch = self.epoch
        chunks = self._chunks(epoch, self.position)
        if self.batch_size is None:
            for chunk in chunks:
                for j in range(len(next(iter(chunk.values())))):
                    self.position += 1
                    yield self._out({k: v[j] for k, v in chunk.items()})
        else:
            yield from self._batches(chunks)
        self.epoch, self.position = epoch + 1, 0

    def _batches(self, chunks: Iterator[dict[str, torch.Tensor]]) -> Iterator[Any]:
        size = self.batch_size
        held: dict[str, torch.Tensor] = {}
        at = 0  # rows of `held` already yielded
        for chunk in chunks:
            held = {k: torch.cat([held[k][at:], v]) if held else v for k, v in chunk.items()}
            at = 0
            while len(held[self.names[0]]) - at >= size:
                self.position += size
                yield self._out({k: v[at : at + size] for k, v in held.items()})
                at += size
        rest = len(held[self.names[0]]) - at if held else 0
        if rest and not self.drop_last:
            self.position += rest
            yield self._out({k: v[at:] for k, v in held.items()})

    def _out(self, columns: dict[str, torch.Tensor]) -> Any:
        return columns[self.names[0]] if self.single else columns

    def _chunks(self, epoch: int, skip: int) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's rows of the epoch, after the first `skip`, as dicts of gathered tensors."""
        start = 0  # position of the window's first kept row in the epoch's stream (all ranks)
        for w, shards in enumerate(self._windows(epoch)):
            kept = sum(self._kept[i] for i in shards)
            mine = self._mine(start, start + kept)
            if skip >= mine:  # restored cursor: pass over whole windows without reading them
                skip -= mine
                start += kept
                continue
            local = self._window_order(epoch, w, shards)[
                (self.rank - start) % self.world_size :: self.world_size]
            local = torch.from_numpy(local[skip:])
            skip = 0
            start += kept
            data = self._load(shards)
            for s in range(0, len(local), _CHUNK):
                idx = local[s : s + _CHUNK]
                yield {k: v[idx] for k, v in data.items()}

    def _windows(self, epoch: int) -> list[list[int]]:
        n = self.store.num_shards
        order = _rng(self.seed, epoch).permutation(n) if self.shuffle else np.arange(n)
        windows, current, rows = [], [], 0
        for i in order.tolist():
            current.append(i)
            rows += self.store.manifest.shards[i].rows
            if rows >= self.buffer_rows:
                windows.append(current)
                current, rows = [], 0
        return windows + [current] if current else windows

    def _window_order(self, epoch: int, w: int, shards: list[int]) -> np.ndarray:
        """Row indices into the window's concatenated shards: kept rows, permuted when shuffling."""
        sizes = [self.store.manifest.shards[i].rows for i in shards]
        if self.split is None:
            local = np.arange(sum(sizes))
        else:
            offsets = np.cumsum([0, *sizes])
            local = np.concatenate([np.flatnonzero(self._keep_mask(i)) + offsets[j]
                                    for j, i in enumerate(shards)])
        return local[_rng(self.seed, epoch, w).permutation(len(local))] if self.shuffle else local

    def _load(self, shards: list[int]) -> dict[str, torch.Tensor]:
        parts = [self.store.load_shard(i, self.names) for i in shards]
        return {k: torch.cat([p[k] for p in parts]) for k in self.names}

    def _keep_mask(self, i: int) -> np.ndarray:
        """Which rows of shard `i` are in this split."""
        rows = self.store.manifest.shards[i].rows
        start = self.store.first_row(i)
        in_val = _unit_hash(np.arange(start, start + rows, dtype=np.uint64)) < self.val_fraction
        return in_val if self.split == "val" else ~in_val

    def _mine(self, a: int, b: int) -> int:
        """How many stream positions in [a, b) belong to this rank."""
        return _below(b, self.rank, self.world_size) - _below(a, self.rank, self.world_size)


def _below(x: int, rank: int, world: int) -> int:
    """How many p in [0, x) have p % world == rank."""
    return (x - rank + world - 1) // world if x > rank else 0


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([*key, len(key)])  # the length keeps (s, e) and (s, e, 0) apart


def _unit_hash(idx: np.ndarray) -> np.ndarray:
    """splitmix64 of each index, mapped to [0, 1): a fixed, platform-independent per-row coin."""
    z = idx + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53
