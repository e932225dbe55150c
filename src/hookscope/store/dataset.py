"""A shuffled, resumable `IterableDataset` over a store's rows.

An epoch is planned without reading any data: the shards are put in a seeded random order and
grouped into windows of at least `buffer_rows` rows; each window's rows (several shards
interleaved) are loaded and yielded in a seeded random permutation. Position p of the epoch's
stream goes to rank p % world_size. Everything is a pure function of (seed, epoch) and the store,
so the sampler's state is just (epoch, rows yielded): restoring it skips whole windows without
reading them and yields exactly the remaining rows.

Reading overlaps consuming: while one window is handed out, a background thread reads the next
one (whole shards, sequentially, which is what disks and page caches are fast at) into memory, so
a trainer sees in-memory gather speed rather than waiting at every window boundary. A batch is one
gather (`index_select`) from the loaded window: no per-row Python work and no second copy.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..errors import StoreError

if TYPE_CHECKING:
    from .reader import Store

_CHUNK = 4096  # rows gathered at once from a loaded window when yielding single rows
# (epoch, loaded columns of a window or None at an epoch's end, this rank's row order in the window)
_Window = tuple[int, "dict[str, torch.Tensor] | None", "torch.Tensor | None"]


class ActivationDataset(IterableDataset):
    """Rows of column(s) `point` (a tensor per row, or a dict of them when `point` is a list);
    with `batch_size`, stacked batches instead.

    `split="train"` / `"val"` keeps the rows whose hashed global index falls above / below
    `val_fraction` (fixed per row, independent of the seed). `rank` / `world_size` give each
    data-parallel process a disjoint share; together they cover every row once per epoch. After
    an epoch is exhausted the dataset moves to the next epoch (a new order); with `repeat=True` one
    `iter()` goes on through epoch after epoch, endlessly (what SAELens's `SAETrainer`,
    dictionary_learning's `trainSAE` and other trainers that call `next()` want), while
    `state_dict()` and `len()` still count one epoch. `prefetch=True` reads the next window in a
    background thread (two windows of `buffer_rows` rows in memory). `state_dict()` is the
    cursor; with a DataLoader worker the copy in the worker advances, not this one, so build the
    state from the rows you consumed: `load_state_dict({"epoch": e, "position": rows_seen, ...})`.
    """

    def __init__(self, store: Store, point: str | Sequence[str], *, shuffle: bool = True, seed: int = 0,
                 buffer_rows: int = 1 << 18, split: str | None = None, val_fraction: float = 0.1,
                 rank: int = 0, world_size: int = 1, epoch: int = 0, batch_size: int | None = None,
                 drop_last: bool = False, repeat: bool = False, prefetch: bool = True):
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
        self.repeat, self.prefetch = repeat, prefetch
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
                             "num_workers=0 or 1 (windows are already prefetched in a background thread)")
        if self.repeat and len(self) == 0:
            raise StoreError(f"repeat=True over {self.rows_per_epoch} rows per epoch"
                             + (f" in batches of {self.batch_size} with drop_last=True"
                                if self.drop_last else "")
                             + " would loop forever without yielding: use a larger store or split, or a "
                             "smaller batch_size")
        windows = self._prefetched(self._plan())
        if self.batch_size is None:
            return self._rows(windows)
        return self._batches(windows)

    def _rows(self, windows: Iterator[_Window]) -> Iterator[Any]:
        for epoch, data, order in windows:
            if data is None:  # the epoch is spent
                self.epoch, self.position = epoch + 1, 0
                continue
            for s in range(0, len(order), _CHUNK):
                chunk = _gather(data, order[s : s + _CHUNK])
                for j in range(len(chunk[self.names[0]])):
                    self.position += 1
                    yield self._out({k: v[j] for k, v in chunk.items()})
            data = chunk = None  # let the window go before the next is handed over

    def _batches(self, windows: Iterator[_Window]) -> Iterator[Any]:
        """Each batch is one gather from a loaded window (no further copy), except the few that
        straddle two windows, which are gathered in two parts and joined."""
        size = self.batch_size
        assert size is not None
        parts: list[dict[str, torch.Tensor]] = []  # the start of a batch that straddles windows
        held = 0  # rows in `parts`
        for epoch, data, order in windows:
            if data is None:  # the epoch is spent: its last, short batch unless drop_last
                if held and not self.drop_last:
                    self.position += held
                    yield self._out(_join(parts))
                parts, held = [], 0
                self.epoch, self.position = epoch + 1, 0
                continue
            at = 0
            if held:
                at = min(size - held, len(order))
                parts.append(_gather(data, order[:at]))
                held += at
                if held < size:
                    data = None
                    continue
                self.position += size
                yield self._out(_join(parts))
                parts, held = [], 0
            while len(order) - at >= size:
                self.position += size
                yield self._out(_gather(data, order[at : at + size]))
                at += size
            if at < len(order):
                parts, held = [_gather(data, order[at:])], len(order) - at
            data = None  # let the window go before the next is handed over

    def _out(self, columns: dict[str, torch.Tensor]) -> Any:
        return columns[self.names[0]] if self.single else columns

    def _plan(self) -> Iterator[tuple[int, list[int] | None, torch.Tensor | None]]:
        """What to read, without reading it: (epoch, shards of a window, this rank's row order in the
        window) for every window that has rows left for this rank, and (epoch, None, None) when an
        epoch ends. One epoch from the cursor; with `repeat`, the following epochs after it."""
        epoch, skip = self.epoch, self.position
        while True:
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
                yield epoch, shards, torch.from_numpy(local[skip:])
                skip = 0
                start += kept
            yield epoch, None, None
            if not self.repeat:
                return
            epoch, skip = epoch + 1, 0

    def _prefetched(self, plan: Iterator[tuple[int, list[int] | None, torch.Tensor | None]]
                    ) -> Iterator[_Window]:
        """The plan's windows, loaded: with `prefetch`, window n+1 is read into memory by a
        background thread while window n is consumed (two windows in memory at most)."""
        if not self.prefetch:
            for epoch, shards, order in plan:
                yield epoch, None if shards is None else self._load(shards), order
            return
        pool = ThreadPoolExecutor(1, thread_name_prefix="hookscope-prefetch")
        finalizing = sys.is_finalizing  # held here: module globals may be gone when Python exits
        queue: deque[tuple[int, torch.Tensor | None, Future | None]] = deque()

        def pull() -> bool:
            item = next(plan, None)
            if item is None:
                return False
            epoch, shards, order = item
            queue.append((epoch, order, None if shards is None else pool.submit(self._load, shards)))
            return True

        try:
            more = pull()
            while queue:
                # one window is being read ahead of the one handed out (an epoch's end marker is no
                # read, so the next epoch's first window is read while this epoch's last is consumed)
                while more and all(future is None for _, _, future in list(queue)[1:]):
                    more = pull()
                epoch, order, future = queue.popleft()
                yield epoch, None if future is None else future.result(), order
        finally:
            if not finalizing():  # at exit, concurrent.futures joins its threads itself
                pool.shutdown(wait=False, cancel_futures=True)  # an abandoned iterator stops reading

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


def _gather(data: dict[str, torch.Tensor], order: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: torch.index_select(v, 0, order) for k, v in data.items()}


def _join(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


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
