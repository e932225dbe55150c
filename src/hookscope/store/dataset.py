"""A shuffled, resumable `IterableDataset` over a store's rows.

An epoch is planned without reading any data: the shards are put in a seeded random order and
grouped into windows of at least `buffer_rows` rows; each window's rows (several shards
interleaved) are loaded and yielded in a seeded random permutation. Position p of the epoch's
stream goes to rank p % world_size. Everything is a pure function of (seed, epoch) and the store,
so the sampler's state is just (epoch, rows yielded): restoring it skips whole windows without
reading them and yields exactly the remaining rows.

Reading overlaps consuming, and nothing is copied twice: a background thread plans the next
window (its rows' places, shuffled: for each position the part and row it is gathered from; each
batch's positions sorted by part when there are several), maps its shards and brings them into
memory (each page touched in file order: the page cache reads the files sequentially and the page
tables are filled) while the previous window is consumed. When an iterator's epoch ends, the next
epoch's first window is read ahead the same way, for the next `iter()`. A batch is then gathered
straight from the mapped shards into its own tensor, one `index_select` per part, so a trainer gets
in-memory gather speed: the same single copy per row as gathering from a tensor already in RAM. Its
memory is that of an earlier batch nothing refers to any more, when there is one (`Recycler`).
On Linux a column's shards are mapped side by side at one row stride (strided.py), so a window is
one part and a batch one `index_select`; elsewhere, or at a URL, each shard is a part. The mappings
are kept from epoch to epoch while the columns read fit in half the RAM (later epochs then touch no
page table at all).

Page size matters at narrow rows: a shard the page cache holds in 2 MiB folios (as Linux leaves
a file the writer has just written) is mapped with 2 MiB pages; one cached by `read()` in small
folios with 4 KiB pages, a TLB miss per random row. Asking for huge pages (`MADV_HUGEPAGE`) would
make cold reads fill 2 MiB folios, but measured slower on cold reads than it gains later, so the
mappings take what the page cache has (bench/RESULTS.md).

Inside a batch the rows come grouped by part: a batch holds exactly the rows of its slice of the
epoch's order (the row-by-row stream), but not in that slice's order, which costs a second copy
to restore and means nothing to a training step. Row-by-row iteration yields the exact order.

With DataLoader workers, batch b of the stream is made by worker b % num_workers (row r: worker
r % num_workers), so the loader's in-order output is exactly the single-process stream, and each
batch is gathered straight into shared memory (the DataLoader then passes a handle, not a copy).
"""

from __future__ import annotations

import os
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.random  # noqa: F401  (else numpy imports it on first use: 10 ms in the first window)
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..errors import StoreError
from .mapper import Mapper, ReadStore
from .recycler import Alloc, Recycler, empty_shared
from .selected import select
from .window import Batch, MappedWindow

_CHUNK = 4096  # rows gathered at once from a mapped window when yielding single rows
# (epoch, the mapped window with this rank's row order, or None at an epoch's end)
_Item = tuple[int, "MappedWindow | None"]
# (window number, its shards, this rank's first position in it, positions already consumed, rows
# this iterator hands out in the epoch before the window: where the window's batches start)
_Job = tuple[int, list[int], int, int, int]
_Plan = Iterator[tuple[int, "_Job | None"]]


class ActivationDataset(IterableDataset):
    """Rows of column(s) `point` (a tensor per row, or a dict of them when `point` is a list or a
    glob); with `batch_size`, stacked batches instead. `stack=True` stacks each pattern's columns,
    in block order: `"blocks.*.resid_post"` gives `[batch, layers, d]` (a crosscoder's input), and
    `["blocks.*.mlp.in", "blocks.*.mlp.out"]` a dict of two such tensors, keyed by pattern, from one
    shuffle order (a cross-layer transcoder's); `stacked` names each stack's columns (store/selected.py).
    A stack is a `[batch, layers, ...]` view of layer-major memory (not `.is_contiguous()`; `.to()`
    keeps that layout, `.contiguous()` makes a row-major copy); stacks of one dtype and row shape (a
    CLT's two) are views of one buffer, so holding either keeps the memory of both.

    `split="train"` / `"val"` keeps the rows whose hashed global index falls above / below
    `val_fraction` (fixed per row, independent of the seed). `rank` / `world_size` give each
    data-parallel process a disjoint share; together they cover every row once per epoch. After
    an epoch is exhausted the dataset moves to the next epoch (a new order); with `repeat=True` one
    `iter()` goes on through epoch after epoch, endlessly (what SAELens's `SAETrainer`,
    dictionary_learning's `trainSAE` and other trainers that call `next()` want), while
    `state_dict()` and `len()` still count one epoch. `prefetch=True` brings the next window's
    pages into memory in a background thread (the page cache holds them; no copy is made). Inside
    a batch, rows come grouped by part (the batch is its slice of the row stream as a set; one part
    unless shards are mapped one by one or their headers differ in length, see strided.py).
    `state_dict()` is the cursor; with DataLoader workers (any number: batch b is worker
    b % num_workers's, so the loader's output is the single-process stream) the copies in the
    workers advance, not this one, so build the state from the rows you consumed:
    `load_state_dict({"epoch": e, "position": rows_seen, ...})`.

    Raises:
        StoreError: a column the store lacks, options out of range, a cursor from another dataset."""

    def __init__(
        self,
        store: ReadStore,
        point: str | Sequence[str],
        *,
        shuffle: bool = True,
        seed: int = 0,
        buffer_rows: int = 1 << 18,
        split: str | None = None,
        val_fraction: float = 0.1,
        rank: int = 0,
        world_size: int = 1,
        epoch: int = 0,
        batch_size: int | None = None,
        drop_last: bool = False,
        repeat: bool = False,
        prefetch: bool = True,
        stack: bool = False,
    ):
        super().__init__()
        selected = select(store.manifest.columns, point, stack, store.path)
        self.names, self._outputs, self._single = selected.names, selected.outputs, selected.single
        self._stacks = {k: v for k, v in selected.outputs.items() if k in selected.stacked}
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
        self.store = store
        self.shuffle, self.seed, self.buffer_rows = shuffle, seed, buffer_rows
        self.split, self.val_fraction, self.rank, self.world_size = split, val_fraction, rank, world_size
        self.batch_size, self.drop_last = batch_size, drop_last
        self.repeat, self.prefetch = repeat, prefetch
        self.epoch, self.position = epoch, 0
        self._mapper: Mapper | None = None
        self._reader: ThreadPoolExecutor | None = None  # the thread that reads windows ahead
        self._reader_pid = 0  # the process it runs in
        # ((epoch, job), its window being read): the next epoch's first window, read ahead while an
        # iterator's last window was consumed, for the next iter() (a plain loop over epochs)
        self._ahead: tuple[tuple[int, _Job], Future] | None = None
        # batch memory reused from epoch to epoch (not in workers): four batches' worth of columns
        self._recycler = Recycler(keep=4 * len(self.names))
        self._kept = [
            int(self._keep_mask(i).sum()) if split else s.rows for i, s in enumerate(store.manifest.shards)
        ]

    def __getstate__(self) -> dict[str, Any]:  # to a DataLoader worker: no mappings, it maps its own
        return {**self.__dict__, "_mapper": None, "_reader": None, "_ahead": None}

    # -- the cursor -------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        if epoch < 0:
            raise StoreError(f"epoch ({epoch}) must be >= 0")
        self.epoch, self.position = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "split": self.split,
            "rows": self.rows_per_epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "rank", "world_size", "split"):
            if key in state and state[key] != getattr(self, key):
                raise StoreError(
                    f"sampler state has {key}={state[key]!r} but this dataset has "
                    f"{getattr(self, key)!r}; build the dataset with the same arguments"
                )
        if "rows" in state and state["rows"] != self.rows_per_epoch:
            raise StoreError(
                f"sampler state was saved over {state['rows']} rows per epoch, this dataset has "
                f"{self.rows_per_epoch}: a different store or split"
            )
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
        if self.repeat and len(self) == 0:
            raise StoreError(
                f"repeat=True over {self.rows_per_epoch} rows per epoch"
                + (f" in batches of {self.batch_size} with drop_last=True" if self.drop_last else "")
                + " would loop forever without yielding: use a larger store or split, or a "
                "smaller batch_size"
            )
        info = get_worker_info()
        # in a DataLoader worker: this worker's share of the stream, gathered into shared memory
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        empty = self._recycler if info is None else empty_shared
        windows = self._prefetched(self._plan(self.epoch, self.position))
        if self.batch_size is None:
            return self._rows(windows, worker, workers, empty)
        return self._batches(windows, worker, workers, empty)

    def _rows(self, windows: Iterator[_Item], worker: int, workers: int, empty: Alloc) -> Iterator[Any]:
        k = 0  # rows of the stream met by this iterator; row k is worker k % workers's
        for epoch, window in windows:
            if window is None:  # the epoch is spent
                self.epoch, self.position = epoch + 1, 0
                continue
            for s in range(0, window.rows, _CHUNK):
                end = min(s + _CHUNK, window.rows)
                mine = slice(s + (worker - k) % workers, end, workers)
                n = len(range(mine.start, end, workers))
                k += end - s
                self.position += end - s - n  # rows other workers yield
                chunk, grouping = window.gather(mine, empty)
                # chunk holds the rows in `grouping` order: row j of `mine` is chunk row inverse[j]
                inverse = range(n) if grouping is None else np.argsort(grouping).tolist()
                for j in inverse:
                    self.position += 1
                    yield self._out({name: v[j] for name, v in chunk.items()})
            window = chunk = None  # let the window go before the next is handed over

    def _batches(self, windows: Iterator[_Item], worker: int, workers: int, empty: Alloc) -> Iterator[Any]:
        """Each batch is gathered straight into its own memory: from one window in one pass, or, for
        the few that straddle windows, each window's rows into their slice of it (no second copy,
        no memory of an odd size). Batches of other workers, and a last short batch that `drop_last`
        drops, are counted, not gathered."""
        size = self.batch_size
        assert size is not None
        per_epoch = self.rows_per_epoch
        b = 0  # batches of the stream met by this iterator; batch b is worker b % workers's
        batch: Batch | None = None  # the batch being filled, when this worker yields it
        held = 0  # rows of the stream in the current batch so far

        def finish() -> dict[str, torch.Tensor] | None:  # a whole batch of `held` rows
            nonlocal b, batch, held
            out = None if batch is None else batch.first(held)
            self.position += held
            b, batch, held = b + 1, None, 0
            return out

        for epoch, window in windows:
            if window is None:  # the epoch is spent: its last, short batch unless drop_last
                if held and not self.drop_last:
                    yield from self._handed(finish())
                batch, held = None, 0
                self.epoch, self.position = epoch + 1, 0
                continue
            at = 0
            while at < window.rows:
                if held == 0:  # a batch begins: its rows are the epoch's next `size`, or what is left
                    rows = min(size, per_epoch - self.position)
                    if b % workers == worker and not (self.drop_last and rows < size):
                        batch = window.new_batch(rows, empty)
                take = min(size - held, window.rows - at)
                if batch is not None:
                    window.fill(batch, slice(at, at + take), held)
                held += take
                at += take
                if held == size:
                    yield from self._handed(finish())
            window = None  # let the window go before the next is handed over

    def _handed(self, out: dict[str, torch.Tensor] | None) -> Iterator[Any]:
        """The batch, if any, no longer held here once handed out: let go, its memory makes the next."""
        yield from () if out is None else (self._out(out),)

    @property
    def stacked(self) -> dict[str, list[str]]:
        """Each stack's key -> its columns (a `--stack` column: its points), in the order of its dim 1."""
        both = {**self.store.manifest.settings.get("stacked", {}), **self._stacks}
        return {k: list(both[k]) for k in self._outputs if k in both}

    def _out(self, columns: dict[str, torch.Tensor]) -> Any:
        return columns[next(iter(self._outputs))] if self._single else columns

    def _plan(self, epoch: int, skip: int) -> _Plan:
        """What to read, without reading or shuffling it: (epoch, job) for every window that has
        rows left for this rank (`_load` makes the job's window), and (epoch, None) when an epoch
        ends. One epoch from the cursor (epoch, rows already yielded); with `repeat`, the following
        epochs after it."""
        while True:
            start = 0  # position of the window's first kept row in the epoch's stream (all ranks)
            handed = 0  # this rank's rows of the epoch this iterator hands out before the window
            for w, shards in enumerate(self._windows(epoch)):
                kept = sum(self._kept[i] for i in shards)
                mine = self._mine(start, start + kept)
                if skip >= mine:  # restored cursor: pass over whole windows without reading them
                    skip -= mine
                    start += kept
                    continue
                yield epoch, (w, shards, (self.rank - start) % self.world_size, skip, handed)
                handed += mine - skip
                skip = 0
                start += kept
            yield epoch, None
            if not self.repeat:
                return
            epoch, skip = epoch + 1, 0

    def _prefetched(self, plan: _Plan) -> Iterator[_Item]:
        """The plan's windows, shuffled and mapped: with `prefetch`, window n+1 is made by a
        background thread while window n is consumed."""
        if self._mapper is None:  # one per dataset: each epoch's iter() finds the shards mapped
            self._mapper = Mapper(self.store, self.names)
        if not self.prefetch:
            for epoch, job in plan:
                yield epoch, None if job is None else self._load(epoch, job)
            return
        if self._reader is None or self._reader_pid != os.getpid():
            # one thread per dataset, kept from iterator to iterator; a forked DataLoader worker
            # inherits the executor and what it was reading but not its thread: it starts its own
            self._reader, self._reader_pid, self._ahead = (
                ThreadPoolExecutor(1, thread_name_prefix="hookscope-prefetch"),
                os.getpid(),
                None,
            )
            weakref.finalize(self, self._reader.shutdown, wait=False, cancel_futures=True)
        pool = self._reader
        queue: deque[tuple[int, Future | None]] = deque()

        def read(epoch: int, job: _Job) -> Future:
            ahead, self._ahead = self._ahead, None
            if ahead is not None and ahead[0] == (epoch, job):  # read ahead by the previous iterator
                return ahead[1]
            return pool.submit(self._load, epoch, job)

        def pull() -> bool:
            item = next(plan, None)
            if item is None:
                return False
            epoch, job = item
            queue.append((epoch, None if job is None else read(epoch, job)))
            return True

        try:
            more = pull()
            while queue:
                # one window is being read ahead of the one handed out (an epoch's end marker is no
                # read, so the next epoch's first window is read while this epoch's last is consumed)
                while more and all(future is None for _, future in list(queue)[1:]):
                    more = pull()
                    if not more:  # this iterator's last window: the next iter()'s first, read ahead
                        self._read_next_epoch_ahead(queue[-1][0] + 1)
                epoch, future = queue.popleft()
                yield epoch, None if future is None else future.result()
        finally:
            for _, future in queue:  # an abandoned iterator stops reading (a read under way ends)
                if future is not None:
                    future.cancel()

    def _read_next_epoch_ahead(self, epoch: int) -> None:
        if self.repeat or self._reader is None:
            return
        first = next(self._plan(epoch, 0))
        if first[1] is not None:
            self._ahead = (first, self._reader.submit(self._load, *first))

    def _load(self, epoch: int, job: _Job) -> MappedWindow:
        """A planned window: its shards mapped and in memory, this rank's rows in their shuffled
        order, less the `skip` a restored cursor consumed already."""
        w, shards, first, skip, handed = job
        assert self._mapper is not None
        layout = self._mapper.layout(shards)
        located = layout.located if self.split is None else layout.located[self._kept_rows(shards)]
        if self.shuffle:  # permuting where the rows lie is permuting the rows: one pass, no lookup after
            located = _rng(self.seed, epoch, w).permutation(located)
        located = np.ascontiguousarray(located[first :: self.world_size][skip:])
        # batches straddle windows: the first `batch_size - handed % batch_size` rows end a batch
        batches = None if self.batch_size is None else (self.batch_size, handed % self.batch_size)
        return MappedWindow(layout, located, not self.shuffle, batches, self._stacks)

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

    def _kept_rows(self, shards: list[int]) -> np.ndarray:
        """Indices into the window's concatenated shards of the rows in this split."""
        offsets = np.cumsum([0, *(self.store.manifest.shards[i].rows for i in shards)])
        return np.concatenate([np.flatnonzero(self._keep_mask(i)) + offsets[j] for j, i in enumerate(shards)])

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
