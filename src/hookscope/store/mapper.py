"""Mapping a dataset's shards and bringing each window into memory before it is used
(store/dataset.py; strided.py maps a column's shards side by side)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from .fs import FS
from .manifest import Manifest
from .strided import Runs
from .window import Layout, located_rows, same_size_ints


@dataclasses.dataclass(frozen=True)
class Placed:
    """Where a column of one shard is mapped: in run `run` of column `owner`'s runs (its own, or an
    equal column's it lies a whole number of rows after in the file), from row `first`."""

    owner: str
    run: int
    first: int


class ReadStore(Protocol):
    """What a dataset reads of a store: a `reader.Store`, which makes datasets (`Store.dataset`), so
    the dataset's modules name the methods they call rather than import its class."""

    path: str
    fs: FS
    manifest: Manifest

    @property
    def num_shards(self) -> int: ...

    def __len__(self) -> int: ...

    def first_row(self, i: int) -> int: ...

    def load_shard(self, i: int, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]: ...

    def read_ahead(self, shards: Sequence[int], names: Sequence[str] | None = None) -> None: ...

    def column_offsets(self, i: int, names: Sequence[str]) -> tuple[Path, dict[str, int]] | None: ...


class Mapper:
    """Maps shards for a dataset and brings each window into memory before it is used. On Linux a
    column's shards are mapped side by side at one stride (strided.py), so a batch is one gather;
    elsewhere, on a URL, or if that mapping fails, shard by shard. The mappings are kept (page tables
    filled, so later epochs fault no page) while the columns read fit in half the RAM; otherwise a
    window's mappings go with it."""

    def __init__(self, store: ReadStore, names: list[str]):
        self.store = store
        self.names = names
        columns = {n: store.manifest.columns[n] for n in names}
        self.dtypes = {n: getattr(torch, c.dtype) for n, c in columns.items()}
        self.row_bytes = {n: c.row_bytes for n, c in columns.items()}
        # columns of one row kind can be rows of one mapping (their bytes gathered as the same ints)
        self.row_kind = {n: (tuple(c.shape), self.dtypes[n].itemsize) for n, c in columns.items()}
        self.keep = sum(c.row_bytes for c in columns.values()) * len(store) <= ram_bytes() // 2
        self.strided = Runs.supported() and not store.fs.remote
        self.mapped: dict[int, dict[str, torch.Tensor]] = {}  # shard by shard: the kept shards
        self.runs: dict[str, Runs] | None = None  # strided and kept: every shard's place, once mapped
        self.placed: dict[int, dict[str, Placed]] = {}  # shard -> column -> where it is mapped

    def layout(self, shards: list[int]) -> Layout:
        """The window of `shards`: mapped, in memory, and where each of its rows lies."""
        if self.strided:
            try:
                return self._strided(shards)
            except OSError:  # no address space, or mmap refused: shard by shard from now on
                self.strided = False
                self.runs = None
                self.placed = {}
        # on a URL the window's shards are fetched concurrently, not one after another
        self.store.read_ahead([i for i in shards if i not in self.mapped], self.names)
        sources = []
        for i in shards:
            columns = self.mapped.get(i)
            if columns is None:  # a new mapping: read it in now (a kept one stays mapped)
                columns = self.store.load_shard(i, self.names)  # checked against the manifest
                for t in columns.values():
                    populate(t)
                if self.keep:
                    self.mapped[i] = columns
            sources.append({k: same_size_ints(v) for k, v in columns.items()})
        sizes = [self.store.manifest.shards[i].rows for i in shards]
        return Layout(sources, self.dtypes, located_rows(range(len(shards)), [0] * len(shards), sizes))

    def _strided(self, shards: list[int]) -> Layout:
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
                placed[i] = self._place(runs, *located)
                for p in placed[i].values():
                    populate(runs[p.owner].tensor(p.run)[p.first : p.first + entries[i].rows])
        # a part: one combination of runs (one per column); almost always a single one
        keys = [tuple((placed[i][n].owner, placed[i][n].run) for n in self.names) for i in shards]
        distinct = list(dict.fromkeys(keys))
        sources = [
            {n: runs[owner].tensor(run) for n, (owner, run) in zip(self.names, key, strict=True)}
            for key in distinct
        ]
        part = [distinct.index(k) for k in keys]
        sizes = [entries[i].rows for i in shards]
        if len(self.names) == 1:
            firsts = [placed[i][self.names[0]].first for i in shards]
            return Layout(sources, self.dtypes, located_rows(part, firsts, sizes), hold=runs)
        rows = {
            n: located_rows([0] * len(shards), [placed[i][n].first for i in shards], sizes)
            for n in self.names
        }
        parts = np.repeat(np.array(part, dtype=np.int64), sizes)
        return Layout(sources, self.dtypes, np.arange(len(parts), dtype=np.int64), parts, rows, hold=runs)

    def _place(self, runs: dict[str, Runs], path: str, offsets: dict[str, int]) -> dict[str, Placed]:
        """Map one shard file: where each column of it is (`Placed`). The file
        is mapped once for all the columns that lie a whole number of rows after an earlier column of
        the same row shape and element size (a writer's equal columns, side by side): they are rows
        of that column's run, so a stack of them is gathered in one `index_select` (window.py)."""
        placed: dict[str, Placed] = {}
        for n in sorted(self.names, key=offsets.__getitem__):  # file order: later columns borrow
            row_bytes = self.row_bytes[n]
            for m, p in placed.items():
                gap = offsets[n] - offsets[m]
                if self.row_kind[m] == self.row_kind[n] and gap % row_bytes == 0:
                    placed[n] = Placed(p.owner, p.run, p.first + gap // row_bytes)
                    break
            else:
                placed[n] = Placed(n, *runs[n].add(path, offsets[n]))
        return placed

    def _new_runs(self, shards: Sequence[int]) -> dict[str, Runs]:
        entries = self.store.manifest.shards
        file_bytes = sum(entries[i].bytes for i in shards)
        return {
            n: Runs(file_bytes, len(shards), tuple(self.store.manifest.columns[n].shape), self.dtypes[n])
            for n in self.names
        }


def ram_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # unknown: keep no mappings
        return 0


_TOUCH = 64 << 10  # a fault maps the cached pages around it: 64 KiB (Linux's fault-around), or 2 MiB


def populate(t: torch.Tensor) -> None:
    """Bring a memory-mapped tensor's pages into memory and into the page tables now, reading the
    file front to back (the kernel reads ahead and maps 16 cached pages per fault), so gathering
    from it later neither waits for the disk nor faults. One byte per 64 KiB is touched (touching
    every page measured slower, warm, with the same pages mapped after) by a numpy reduction: one
    thread, the GIL released, so the consumer keeps running (a torch reduction starts a second team
    of torch's threads beside the consumer's `index_select`, and warm reading measured slower with
    it). (`MADV_POPULATE_READ` measured slower than touching, warm and cold.)"""
    if t.numel():
        t.reshape(-1).view(torch.uint8).numpy()[::_TOUCH].max()
