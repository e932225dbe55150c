"""A shuffled, resumable `IterableDataset` over a store's rows.

An epoch is planned without reading any data: the shards are put in a seeded random order and
grouped into windows of at least `buffer_rows` rows; each window's rows (several shards
interleaved) are loaded and yielded in a seeded random permutation. Position p of the epoch's
stream goes to rank p % world_size. Everything is a pure function of (seed, epoch) and the store,
so the sampler's state is just (epoch, rows yielded): restoring it skips whole windows without
reading them and yields exactly the remaining rows.

The planning (which shards and rows, in which order, for (seed, epoch, rank)) is store/planning.py's;
the reading ahead store/prefetch.py's; this module yields the rows and batches.

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

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..errors import StoreError
from .mapper import Mapper, ReadStore
from .planning import DatasetOptions, EpochEnd, Planner, WindowPlan
from .prefetch import Prefetcher
from .recycler import Alloc, Recycler, empty_shared
from .selected import select
from .window import Batch, MappedWindow

_CHUNK = 4096  # rows gathered at once from a mapped window when yielding single rows
Windows = Iterator[MappedWindow | EpochEnd]


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

    The options come as keywords (`seed=3, batch_size=4096`) or as a `DatasetOptions` (then
    keywords given too replace its fields); `options` holds them.

    Raises:
        StoreError: a column the store lacks, options out of range, a cursor from another dataset."""

    def __init__(
        self,
        store: ReadStore,
        point: str | Sequence[str],
        options: DatasetOptions | None = None,
        /,
        **keywords: Any,
    ):
        super().__init__()
        self.options = (
            DatasetOptions(**keywords) if options is None else dataclasses.replace(options, **keywords)
        )
        selected = select(store.manifest.columns, point, self.options.stack, store.path)
        self.names = selected.names
        self._outputs = selected.outputs
        self._single = selected.single
        self._stacks = {k: v for k, v in selected.outputs.items() if k in selected.stacked}
        self.store = store
        self.epoch = self.options.epoch  # the cursor: the epoch, and the rows of it yielded
        self.position = 0
        self._planner = Planner(store, self.options)  # store/planning.py
        # made on the first read, one per dataset: each epoch's iter() finds the shards mapped
        self._mapper: Mapper | None = None
        self._prefetcher = Prefetcher()  # store/prefetch.py
        # batch memory reused from epoch to epoch (not in workers): four batches' worth of columns
        self._recycler = Recycler(keep=4 * len(self.names))

    def __getstate__(self) -> dict[str, Any]:  # to a DataLoader worker: no mappings, it maps its own
        return {**self.__dict__, "_mapper": None, "_prefetcher": Prefetcher()}

    # -- the cursor -------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        if epoch < 0:
            raise StoreError(f"epoch ({epoch}) must be >= 0")
        self.epoch = epoch
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.options.seed,
            "rank": self.options.rank,
            "world_size": self.options.world_size,
            "split": self.options.split,
            "rows": self.rows_per_epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "rank", "world_size", "split"):
            if key in state and state[key] != getattr(self.options, key):
                raise StoreError(
                    f"sampler state has {key}={state[key]!r} but this dataset has "
                    f"{getattr(self.options, key)!r}; build the dataset with the same arguments"
                )
        if "rows" in state and state["rows"] != self.rows_per_epoch:
            raise StoreError(
                f"sampler state was saved over {state['rows']} rows per epoch, this dataset has "
                f"{self.rows_per_epoch}: a different store or split"
            )
        if not 0 <= state["position"] <= self.rows_per_epoch:
            raise StoreError(f"sampler position {state['position']} is outside 0..{self.rows_per_epoch}")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])

    # -- sizes ------------------------------------------------------------------------------------

    @property
    def rows_per_epoch(self) -> int:
        """Rows this rank yields per epoch."""
        return self._planner.rows_per_epoch

    def __len__(self) -> int:
        rows = self.rows_per_epoch
        size = self.options.batch_size
        if size is None:
            return rows
        return rows // size if self.options.drop_last else -(-rows // size)

    # -- iteration --------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        options = self.options
        if options.repeat and len(self) == 0:
            raise StoreError(
                f"repeat=True over {self.rows_per_epoch} rows per epoch"
                + (f" in batches of {options.batch_size} with drop_last=True" if options.drop_last else "")
                + " would loop forever without yielding: use a larger store or split, or a "
                "smaller batch_size"
            )
        info = get_worker_info()
        # in a DataLoader worker: this worker's share of the stream, gathered into shared memory
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        empty = self._recycler if info is None else empty_shared
        windows = self._read(self._planner.plan(self.epoch, self.position))
        if options.batch_size is None:
            return self._rows(windows, worker, workers, empty)
        return self._batches(windows, worker, workers, empty)

    def _rows(self, windows: Windows, worker: int, workers: int, empty: Alloc) -> Iterator[Any]:
        k = 0  # rows of the stream met by this iterator; row k is worker k % workers's
        for window in windows:
            if isinstance(window, EpochEnd):
                self._next_epoch(window)
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

    def _batches(self, windows: Windows, worker: int, workers: int, empty: Alloc) -> Iterator[Any]:
        """Each batch is gathered straight into its own memory: from one window in one pass, or, for
        the few that straddle windows, each window's rows into their slice of it (no second copy,
        no memory of an odd size). Batches of other workers, and a last short batch that `drop_last`
        drops, are counted, not gathered."""
        size = self.options.batch_size
        drop_last = self.options.drop_last
        assert size is not None
        per_epoch = self.rows_per_epoch
        b = 0  # batches of the stream met by this iterator; batch b is worker b % workers's
        batch: Batch | None = None  # the batch being filled, when this worker yields it
        held = 0  # rows of the stream in the current batch so far

        def finish() -> dict[str, torch.Tensor] | None:  # a whole batch of `held` rows
            nonlocal b, batch, held
            out = None if batch is None else batch.first(held)
            self.position += held
            b += 1
            batch = None
            held = 0
            return out

        for window in windows:
            if isinstance(window, EpochEnd):  # its last, short batch unless drop_last
                if held and not drop_last:
                    yield from self._handed(finish())
                batch = None
                held = 0
                self._next_epoch(window)
                continue
            at = 0
            while at < window.rows:
                if held == 0:  # a batch begins: its rows are the epoch's next `size`, or what is left
                    rows = min(size, per_epoch - self.position)
                    if b % workers == worker and not (drop_last and rows < size):
                        batch = window.new_batch(rows, empty)
                take = min(size - held, window.rows - at)
                if batch is not None:
                    window.fill(batch, slice(at, at + take), held)
                held += take
                at += take
                if held == size:
                    yield from self._handed(finish())
            window = None  # let the window go before the next is handed over

    def _next_epoch(self, end: EpochEnd) -> None:
        """The cursor at the start of the epoch after `end`'s."""
        self.epoch = end.epoch + 1
        self.position = 0

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

    def _read(self, plan: Iterator[WindowPlan | EpochEnd]) -> Windows:
        """The plan's windows, shuffled and mapped: with `prefetch`, window n+1 is made by a
        background thread while window n is consumed (store/prefetch.py)."""
        if self._mapper is None:
            self._mapper = Mapper(self.store, self.names)
        if self.options.prefetch:
            yield from self._prefetcher.windows(plan, self._load, self._first_of_next_epoch)
            return
        for item in plan:
            yield item if isinstance(item, EpochEnd) else self._load(item)

    def _first_of_next_epoch(self, epoch: int) -> WindowPlan | None:
        """The window to read ahead for the next `iter()` (none when one `iter()` runs on, repeating)."""
        return None if self.options.repeat else self._planner.first_window(epoch)

    def _load(self, window: WindowPlan) -> MappedWindow:
        """A planned window: its shards mapped and in memory, this rank's rows in their shuffled
        order, less the `skip` a restored cursor consumed already."""
        assert self._mapper is not None
        layout = self._mapper.layout(window.shards)
        located = self._planner.order(layout.located, window)
        size = self.options.batch_size
        # batches straddle windows: the first `size - handed % size` rows end a batch
        batches = None if size is None else (size, window.handed % size)
        return MappedWindow(layout, located, not self.options.shuffle, batches, self._stacks)
