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
memory is that of an earlier batch nothing refers to any more, when there is one (`_Recycler`).
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
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.random  # noqa: F401  (else numpy imports it on first use: 10 ms in the first window)
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..errors import StoreError
from .strided import Runs

if TYPE_CHECKING:
    from .reader import Store

_CHUNK = 4096  # rows gathered at once from a mapped window when yielding single rows
# (epoch, the mapped window with this rank's row order, or None at an epoch's end)
_Item = tuple[int, "_MappedWindow | None"]
# (window number, its shards, this rank's first position in it, positions already consumed, rows
# this iterator hands out in the epoch before the window: where the window's batches start)
_Job = tuple[int, list[int], int, int, int]
_Plan = Iterator[tuple[int, "_Job | None"]]


class ActivationDataset(IterableDataset):
    """Rows of column(s) `point` (a tensor per row, or a dict of them when `point` is a list);
    with `batch_size`, stacked batches instead.

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
        self._mapper: _Mapper | None = None
        self._reader: ThreadPoolExecutor | None = None  # the thread that reads windows ahead
        self._reader_pid = 0  # the process it runs in
        # ((epoch, job), its window being read): the next epoch's first window, read ahead while an
        # iterator's last window was consumed, for the next iter() (a plain loop over epochs)
        self._ahead: tuple[tuple[int, _Job], Future] | None = None
        # batch memory reused from epoch to epoch (not in workers): four batches' worth of columns
        self._recycler = _Recycler(keep=4 * len(self.names))
        self._kept = [int(self._keep_mask(i).sum()) if split else s.rows
                      for i, s in enumerate(store.manifest.shards)]

    def __getstate__(self) -> dict[str, Any]:  # to a DataLoader worker: no mappings, it maps its own
        return {**self.__dict__, "_mapper": None, "_reader": None, "_ahead": None}

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
        if self.repeat and len(self) == 0:
            raise StoreError(f"repeat=True over {self.rows_per_epoch} rows per epoch"
                             + (f" in batches of {self.batch_size} with drop_last=True"
                                if self.drop_last else "")
                             + " would loop forever without yielding: use a larger store or split, or a "
                             "smaller batch_size")
        info = get_worker_info()
        # in a DataLoader worker: this worker's share of the stream, gathered into shared memory
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        empty = self._recycler if info is None else _empty_shared
        windows = self._prefetched(self._plan(self.epoch, self.position))
        if self.batch_size is None:
            return self._rows(windows, worker, workers, empty)
        return self._batches(windows, worker, workers, empty)

    def _rows(self, windows: Iterator[_Item], worker: int, workers: int, empty: _Alloc) -> Iterator[Any]:
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

    def _batches(self, windows: Iterator[_Item], worker: int, workers: int,
                 empty: _Alloc) -> Iterator[Any]:
        """Each batch is gathered from the mapped window in one pass, except the few that straddle
        two windows, which are gathered in two parts and joined. Batches of other workers are
        counted, not gathered."""
        size = self.batch_size
        assert size is not None
        b = 0  # batches of the stream met by this iterator; batch b is worker b % workers's
        parts: list[dict[str, torch.Tensor]] = []  # the start of a batch that straddles windows
        held = 0  # rows in `parts` (or, for another worker's batch, rows counted)

        def finish() -> dict[str, torch.Tensor] | None:  # a whole batch of `held` rows
            nonlocal b, parts, held
            mine = b % workers == worker
            out = _join(parts, empty) if mine else None
            self.position += held
            b, parts, held = b + 1, [], 0
            return out

        for epoch, window in windows:
            if window is None:  # the epoch is spent: its last, short batch unless drop_last
                if held and not self.drop_last:
                    batch = finish()
                    if batch is not None:
                        yield self._out(batch)
                parts, held = [], 0
                self.epoch, self.position = epoch + 1, 0
                continue
            at = 0
            while at < window.rows:
                take = min(size - held, window.rows - at)
                if b % workers == worker:
                    parts.append(window.gather(slice(at, at + take), empty)[0])
                held += take
                at += take
                if held == size:
                    batch = finish()
                    if batch is not None:
                        yield self._out(batch)
            window = None  # let the window go before the next is handed over

    def _out(self, columns: dict[str, torch.Tensor]) -> Any:
        return columns[self.names[0]] if self.single else columns

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
            self._mapper = _Mapper(self.store, self.names)
        if not self.prefetch:
            for epoch, job in plan:
                yield epoch, None if job is None else self._load(epoch, job)
            return
        if self._reader is None or self._reader_pid != os.getpid():
            # one thread per dataset, kept from iterator to iterator; a forked DataLoader worker
            # inherits the executor and what it was reading but not its thread: it starts its own
            self._reader, self._reader_pid, self._ahead = (
                ThreadPoolExecutor(1, thread_name_prefix="hookscope-prefetch"), os.getpid(), None)
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

    def _load(self, epoch: int, job: _Job) -> _MappedWindow:
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
        return _MappedWindow(layout, located, not self.shuffle, batches)

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


_Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def _new_array(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    return np.empty(shape, dtype=dtype)  # numpy asks for transparent huge pages on large arrays


def _refs(kept: list[np.ndarray], i: int) -> int:
    return sys.getrefcount(kept[i])


_UNHELD = _refs([np.empty(1)], 0)  # what _refs counts for an array only the list holds


class _Recycler:
    """New batches in memory that a batch let go of earlier, else newly allocated by numpy.

    Faulting a fresh 32 MiB batch in (4,096 x 4,096 float16) costs as much as gathering its rows, and more
    at random in a process's first epochs (bench/RESULTS.md); rewriting memory already faulted in costs
    nothing extra. (A new batch comes from numpy, which asks for transparent huge pages: 16 page faults
    for 32 MiB where torch's allocator takes 8,192.) A buffer is reused only when nothing outside this
    pool refers to it: every tensor, view, `.numpy()` or DLPack capsule of a batch keeps its torch storage
    alive, and the storage holds one reference to the numpy array under it, so an array whose only
    reference is the pool's belongs to no live batch. A batch the consumer keeps is never overwritten; a
    new one is allocated instead. At most `keep` buffers are kept (a dataset keeps four a column), for
    the dataset's life (so each epoch starts on memory already faulted in); a lock keeps two iterators
    on two threads from taking the same one."""

    def __init__(self, keep: int = 4):
        self.keep = keep
        self.kept: list[np.ndarray] = []
        self.lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # to a DataLoader worker: an empty pool, no lock
        return {"keep": self.keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["keep"])

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        ints, shape = _SAME_SIZE_NP[dtype.itemsize], tuple(shape)
        with self.lock:
            unheld = None  # a free buffer of another shape, which a new one may replace
            for i in range(len(self.kept)):  # by index: a loop variable would hold a reference too
                if _refs(self.kept, i) == _UNHELD:
                    if self.kept[i].shape == shape and self.kept[i].dtype == ints:
                        return torch.from_numpy(self.kept[i]).view(dtype)
                    unheld = i
            array = _new_array(shape, ints)
            if len(self.kept) < self.keep:
                self.kept.append(array)
            elif unheld is not None:
                self.kept[unheld] = array
            return torch.from_numpy(array).view(dtype)


def _empty_shared(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor in shared memory (what a DataLoader worker's batches should be made in: sending
    one then passes a handle instead of copying it into shared memory first)."""
    nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(torch.UntypedStorage._new_shared(nbytes), 0, shape)


_SHIFT = 40  # a located row: part << _SHIFT | row (rows of a part < 2**40)


def _located(parts: Sequence[int], firsts: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
    """Where each row of shards placed at (part, first row) with `sizes` rows lies, packed."""
    if not sizes:
        return np.zeros(0, np.int64)
    return np.concatenate([np.arange(f, f + n, dtype=np.int64) + (p << _SHIFT)
                           for p, f, n in zip(parts, firsts, sizes, strict=True)])


class _Layout:
    """Where a window's rows lie. `sources[j]` holds part j's tensor of each column (a part: shards
    mapped side by side at one stride, strided.py, or one shard). `located[r]` says where the
    window's row r is: `part << _SHIFT | row` when all columns have it at the same row (one column,
    or shards mapped one by one); else r itself, with its part in `parts[r]` and its row in each
    column in `rows[name][r]`. `hold` keeps the mappings alive."""

    def __init__(self, sources: list[dict[str, torch.Tensor]], dtypes: dict[str, torch.dtype],
                 located: np.ndarray, parts: np.ndarray | None = None,
                 rows: dict[str, np.ndarray] | None = None, hold: object = None):
        self.sources, self.dtypes, self.located = sources, dtypes, located
        self.parts, self.rows, self.hold = parts, rows, hold

    def decode(self, located: np.ndarray) -> tuple[np.ndarray | None, dict[str, np.ndarray]]:
        """(the part of each of `located`, None if there is one part; its row in each column)."""
        small = np.uint16 if len(self.sources) < 1 << 16 else np.int64  # numpy radix-sorts small ints
        if self.rows is None:
            if len(self.sources) == 1:
                return None, dict.fromkeys(self.dtypes, located)
            rows = located & ((1 << _SHIFT) - 1)
            return (located >> _SHIFT).astype(small), dict.fromkeys(self.dtypes, rows)
        assert self.parts is not None
        part = None if len(self.sources) == 1 else self.parts[located].astype(small)
        return part, {name: r[located] for name, r in self.rows.items()}


class _MappedWindow:
    """A window's mapped columns and this rank's rows of it in their order: for each position, the
    part holding its row and the row there (worked out once a window, by the thread that maps it,
    so a batch only slices them)."""

    def __init__(self, layout: _Layout, located: np.ndarray, ordered: bool, batches: tuple[int, int] | None):
        """`located`: the window's rows for this rank, in order (see _Layout); `ordered`: sequential."""
        self.sources, self.dtypes, self.hold = layout.sources, layout.dtypes, layout
        self.rows = len(located)
        self.part, rows = layout.decode(located)
        # grouped: each batch's positions come in few runs of one part (so gathering needs no sort)
        self.grouped = self.part is None or ordered
        if batches is not None and not self.grouped:
            assert self.part is not None
            # batch by batch (`batches` = (size, rows of a batch begun before the window)), the
            # positions sorted by part now, so that gathering a batch sorts nothing
            size, begun = batches
            parts = len(self.sources)
            batch = (np.arange(self.rows, dtype=np.int64) + begun) // size
            key = batch * parts + self.part
            if (self.rows - 1 + begun) // size * parts + parts <= 1 << 16:
                key = key.astype(np.uint16)  # numpy radix-sorts 16-bit keys: 2x faster
            grouped = np.argsort(key, kind="stable")
            self.part = self.part[grouped]
            rows = {name: r[grouped] for name, r in rows.items()}
            self.grouped = True  # a batch's positions as a set are unchanged, now in part order
        index: dict[int, torch.Tensor] = {}  # columns sharing one rows array share one index
        for r in rows.values():
            index.setdefault(id(r), torch.from_numpy(r))
        self.index = {name: index[id(r)] for name, r in rows.items()}

    def gather(self, positions: slice, empty: _Alloc) -> tuple[dict[str, torch.Tensor], np.ndarray | None]:
        """The rows at `positions` of the order, each column in one new tensor, grouped by part:
        returns (columns, grouping) with columns row k = the row at position positions[grouping[k]]
        (grouping None: in order)."""
        n = len(range(*positions.indices(self.rows)))
        out = {k: empty((n, *v.shape[1:]), self.dtypes[k]) for k, v in self.sources[0].items()}
        outs = {k: _same_size_ints(v) for k, v in out.items()}
        index = {k: v[positions] for k, v in self.index.items()}
        if self.part is None:  # one part: the whole batch in one gather per column
            for k, source in self.sources[0].items():
                torch.index_select(source, 0, index[k].contiguous(), out=outs[k])
            return out, None
        part = self.part[positions]
        # a stable sort of small integers is a radix sort in numpy: linear in the batch
        grouping = None if self.grouped else np.argsort(part, kind="stable")
        if grouping is not None:
            part = part[grouping]
            at = torch.from_numpy(grouping)
            index = {k: v[at] for k, v in index.items()}
        cuts = [0, *(np.flatnonzero(part[1:] != part[:-1]) + 1).tolist(), n]
        for a, b in zip(cuts, cuts[1:], strict=False):
            if b > a:
                for k, source in self.sources[int(part[a])].items():
                    # torch's gather, on its threads: 1.3x numpy's one-thread `take` from mapped
                    # shards (768 and 4096 columns, idle 2-core machine, into a numpy-allocated batch)
                    torch.index_select(source, 0, index[k][a:b].contiguous(), out=outs[k][a:b])
        return out, grouping


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SAME_SIZE_NP = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def _same_size_ints(t: torch.Tensor) -> torch.Tensor:
    """`t` viewed as integers of its element size: whole rows of bytes to gather (any dtype,
    bfloat16 and bool included; no conversion, one gather kernel)."""
    return t.view(_SAME_SIZE_INT[t.element_size()])


class _Mapper:
    """Maps shards for a dataset and brings each window into memory before it is used. On Linux a
    column's shards are mapped side by side at one stride (strided.py), so a batch is one gather;
    elsewhere, on a URL, or if that mapping fails, shard by shard. The mappings are kept (page tables
    filled, so later epochs fault no page) while the columns read fit in half the RAM; otherwise a
    window's mappings go with it."""

    def __init__(self, store: Store, names: list[str]):
        self.store, self.names = store, names
        columns = {n: store.manifest.columns[n] for n in names}
        self.dtypes = {n: getattr(torch, c.dtype) for n, c in columns.items()}
        row_bytes = sum(int(np.prod(c.shape, dtype=np.int64)) * self.dtypes[n].itemsize
                        for n, c in columns.items())
        self.keep = row_bytes * len(store) <= _ram_bytes() // 2
        self.strided = Runs.supported() and store.remote is None
        self.mapped: dict[int, dict[str, torch.Tensor]] = {}  # shard by shard: the kept shards
        self.runs: dict[str, Runs] | None = None  # strided and kept: every shard's place, once mapped
        self.placed: dict[int, dict[str, tuple[int, int]]] = {}  # shard -> column -> (run, first row)

    def layout(self, shards: list[int]) -> _Layout:
        """The window of `shards`: mapped, in memory, and where each of its rows lies."""
        if self.strided:
            try:
                return self._strided(shards)
            except OSError:  # no address space, or mmap refused: shard by shard from now on
                self.strided, self.runs, self.placed = False, None, {}
        # on a URL the window's shards are fetched concurrently, not one after another
        self.store.read_ahead([i for i in shards if i not in self.mapped], self.names)
        sources = []
        for i in shards:
            columns = self.mapped.get(i)
            if columns is None:  # a new mapping: read it in now (a kept one stays mapped)
                columns = self.store.load_shard(i, self.names)  # checked against the manifest
                for t in columns.values():
                    _populate(t)
                if self.keep:
                    self.mapped[i] = columns
            sources.append({k: _same_size_ints(v) for k, v in columns.items()})
        sizes = [self.store.manifest.shards[i].rows for i in shards]
        return _Layout(sources, self.dtypes, _located(range(len(shards)), [0] * len(shards), sizes))

    def _strided(self, shards: list[int]) -> _Layout:
        entries = self.store.manifest.shards
        if self.keep:  # one layout for the store, filled as windows come
            if self.runs is None:
                self.runs = self._new_runs(range(len(entries)))
            runs, placed = self.runs, self.placed
        else:  # this window's own, unmapped with it
            runs, placed = self._new_runs(shards), {}
        for i in shards:
            if i not in placed:
                located = self.store.column_offsets(i, self.names)  # checked against the manifest
                if located is None:  # a dtype it cannot check in the header: shard by shard
                    raise OSError("not mappable")
                path, offsets = located
                placed[i] = {n: runs[n].add(path, offsets[n]) for n in self.names}
                for n, (run, first) in placed[i].items():
                    _populate(runs[n].tensor(run)[first : first + entries[i].rows])
        # a part: one combination of runs (one per column); almost always a single one
        keys = [tuple(placed[i][n][0] for n in self.names) for i in shards]
        distinct = list(dict.fromkeys(keys))
        sources = [{n: runs[n].tensor(run) for n, run in zip(self.names, key, strict=True)}
                   for key in distinct]
        part = [distinct.index(k) for k in keys]
        sizes = [entries[i].rows for i in shards]
        if len(self.names) == 1:
            firsts = [placed[i][self.names[0]][1] for i in shards]
            return _Layout(sources, self.dtypes, _located(part, firsts, sizes), hold=runs)
        rows = {n: _located([0] * len(shards), [placed[i][n][1] for i in shards], sizes) for n in self.names}
        parts = np.repeat(np.array(part, dtype=np.int64), sizes)
        return _Layout(sources, self.dtypes, np.arange(len(parts), dtype=np.int64), parts, rows, hold=runs)

    def _new_runs(self, shards: Sequence[int]) -> dict[str, Runs]:
        entries = self.store.manifest.shards
        file_bytes = sum(entries[i].bytes for i in shards)
        return {n: Runs(file_bytes, len(shards), tuple(self.store.manifest.columns[n].shape), self.dtypes[n])
                for n in self.names}


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # unknown: keep no mappings
        return 0


_TOUCH = 64 << 10  # a fault maps the cached pages around it: 64 KiB (Linux's fault-around), or 2 MiB


def _populate(t: torch.Tensor) -> None:
    """Bring a memory-mapped tensor's pages into memory and into the page tables now, reading the
    file front to back (the kernel reads ahead and maps 16 cached pages per fault), so gathering
    from it later neither waits for the disk nor faults. One byte per 64 KiB is touched (every
    page: 1.3-2.5x slower, warm, with the same pages mapped after) by a numpy
    reduction: one thread, the GIL released, so the consumer keeps running (a torch reduction starts
    a second team of torch's threads beside the consumer's `index_select`: warm reading measured
    1.17-1.28x faster with numpy here). (`MADV_POPULATE_READ` was measured 1.5-5x slower than
    touching, warm and cold.)"""
    if t.numel():
        t.reshape(-1).view(torch.uint8).numpy()[::_TOUCH].max()


def _join(parts: list[dict[str, torch.Tensor]], empty: _Alloc) -> dict[str, torch.Tensor]:
    if len(parts) == 1:
        return parts[0]
    out = {}
    for k, first in parts[0].items():
        out[k] = empty((sum(len(p[k]) for p in parts), *first.shape[1:]), first.dtype)
        torch.cat([p[k] for p in parts], out=out[k])
    return out


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
