"""The dataset's options, and its planning: which shards, in which windows, and which of their rows in
which order, for (seed, epoch, rank), without reading any data (store/dataset.py reads and yields).

An epoch's shards are put in a seeded random order and grouped into windows of at least
`buffer_rows` rows; each window's rows are permuted by a generator seeded with (seed, epoch,
window). Position p of the epoch's stream goes to rank p % world_size. A cursor (epoch, rows this
rank yielded) passes over whole windows without reading them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import numpy.random  # noqa: F401  (else numpy imports it on first use, inside the first window's time)

from ..errors import StoreError
from .mapper import ReadStore


@dataclasses.dataclass(frozen=True)
class DatasetOptions:
    """How an `ActivationDataset` reads a store: the keywords of `Store.dataset` (its docstring and
    `ActivationDataset`'s say what each does).

    Raises:
        StoreError: an option out of range."""

    shuffle: bool = True
    seed: int = 0
    buffer_rows: int = 1 << 18
    split: str | None = None
    val_fraction: float = 0.1
    rank: int = 0
    world_size: int = 1
    epoch: int = 0  # the epoch the dataset starts at; the cursor moves on from there
    batch_size: int | None = None
    drop_last: bool = False
    repeat: bool = False
    prefetch: bool = True
    stack: bool = False

    def __post_init__(self) -> None:
        if self.split not in (None, "train", "val"):
            raise StoreError(f"split={self.split!r}: use None, 'train' or 'val'")
        if self.split is not None and not 0.0 < self.val_fraction < 1.0:
            raise StoreError(f"val_fraction={self.val_fraction} must be between 0 and 1")
        if not 0 <= self.rank < self.world_size:
            raise StoreError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.buffer_rows < 1 or (self.batch_size is not None and self.batch_size < 1):
            raise StoreError("buffer_rows and batch_size must be >= 1")
        if self.seed < 0 or self.epoch < 0:
            raise StoreError(f"seed ({self.seed}) and epoch ({self.epoch}) must be >= 0")


@dataclasses.dataclass(frozen=True)
class WindowPlan:
    """One window of an epoch, planned for this rank: what it takes to read it, nothing read yet."""

    epoch: int
    number: int  # the window's place in the epoch: its shuffle is drawn from (seed, epoch, number)
    shards: list[int]
    first: int  # this rank's first position in the window
    skip: int  # this rank's rows of the window that a restored cursor consumed already
    handed: int  # rows this iterator hands out in the epoch before the window: where its batches start


@dataclasses.dataclass(frozen=True)
class EpochEnd:
    """The end of epoch `epoch` in a stream of windows."""

    epoch: int


class Planner:
    """The plan of a store's epochs for one rank: a pure function of the options and the store."""

    def __init__(self, store: ReadStore, options: DatasetOptions):
        self.store = store
        self.options = options
        # the rows of each shard in the split
        self.kept = [
            int(self._keep_mask(i).sum()) if options.split else s.rows
            for i, s in enumerate(store.manifest.shards)
        ]

    @property
    def rows_per_epoch(self) -> int:
        """Rows this rank yields per epoch."""
        return self._mine(0, sum(self.kept))

    def plan(self, epoch: int, skip: int) -> Iterator[WindowPlan | EpochEnd]:
        """What to read, without reading or shuffling it: every window that has rows left for this
        rank, and an `EpochEnd` when an epoch ends. One epoch from the cursor (epoch, rows already
        yielded); with `repeat`, the following epochs after it."""
        rank = self.options.rank
        world_size = self.options.world_size
        while True:
            start = 0  # position of the window's first kept row in the epoch's stream (all ranks)
            handed = 0  # this rank's rows of the epoch this iterator hands out before the window
            for number, shards in enumerate(self.windows(epoch)):
                kept = sum(self.kept[i] for i in shards)
                mine = self._mine(start, start + kept)
                if skip >= mine:  # restored cursor: pass over whole windows without reading them
                    skip -= mine
                    start += kept
                    continue
                yield WindowPlan(epoch, number, shards, (rank - start) % world_size, skip, handed)
                handed += mine - skip
                skip = 0
                start += kept
            yield EpochEnd(epoch)
            if not self.options.repeat:
                return
            epoch += 1
            skip = 0

    def first_window(self, epoch: int) -> WindowPlan | None:
        """Epoch `epoch`'s first window, from its start (None: the epoch has no rows for this rank)."""
        first = next(self.plan(epoch, 0))
        return first if isinstance(first, WindowPlan) else None

    def windows(self, epoch: int) -> list[list[int]]:
        """The epoch's shards, in windows of at least `buffer_rows` rows (the last may hold fewer)."""
        n = self.store.num_shards
        order = _rng(self.options.seed, epoch).permutation(n) if self.options.shuffle else np.arange(n)
        windows = []
        current = []
        rows = 0
        for i in order.tolist():
            current.append(i)
            rows += self.store.manifest.shards[i].rows
            if rows >= self.options.buffer_rows:
                windows.append(current)
                current = []
                rows = 0
        return windows + [current] if current else windows

    def order(self, located: np.ndarray, window: WindowPlan) -> np.ndarray:
        """This rank's rows of `window`, in their shuffled order, less the `skip` a restored cursor
        consumed already: `located` (where each of the window's rows lies), cut and permuted."""
        if self.options.split is not None:
            located = located[self._kept_rows(window.shards)]
        if (
            self.options.shuffle
        ):  # permuting where the rows lie is permuting the rows: one pass, no lookup after
            located = _rng(self.options.seed, window.epoch, window.number).permutation(located)
        return np.ascontiguousarray(located[window.first :: self.options.world_size][window.skip :])

    def _kept_rows(self, shards: list[int]) -> np.ndarray:
        """Indices into the window's concatenated shards of the rows in this split."""
        offsets = np.cumsum([0, *(self.store.manifest.shards[i].rows for i in shards)])
        return np.concatenate([np.flatnonzero(self._keep_mask(i)) + offsets[j] for j, i in enumerate(shards)])

    def _keep_mask(self, i: int) -> np.ndarray:
        """Which rows of shard `i` are in this split."""
        rows = self.store.manifest.shards[i].rows
        start = self.store.first_row(i)
        in_val = _unit_hash(np.arange(start, start + rows, dtype=np.uint64)) < self.options.val_fraction
        return in_val if self.options.split == "val" else ~in_val

    def _mine(self, a: int, b: int) -> int:
        """How many stream positions in [a, b) belong to this rank."""
        rank = self.options.rank
        world_size = self.options.world_size
        return _below(b, rank, world_size) - _below(a, rank, world_size)


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
