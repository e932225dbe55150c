"""Write a store: a background thread turns batches into safetensors shards while the caller computes.

Crash safety rests on three rules. A shard is written under a `.tmp` name in the writer's own
staging directory (`shards/shard-r000-writing/`: what a crash leaves there, safetensors' own
temporary file included, is found and deleted by the next writer), fsynced and renamed into place;
the manifest is then replaced atomically; and a batch counts as done only once the manifest lists
the shard holding it. Shards are cut at batch boundaries only, so every committed shard holds whole
batches, and a resumed run that skips `done_batches` writes each batch exactly once. Because the
cut points depend only on the sequence of batches, a resumed store equals an uninterrupted one
shard for shard. A resume with another number of ranks re-deals the batches not yet committed
(see store/resume.py).
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Self

import torch

from ..errors import StoreError
from .checksum import ALGORITHMS, WRITTEN
from .committer import Committer
from .handoff import Handoff
from .manifest import SHARDS_DIR, Column, Manifest, ShardEntry, runs_of, shard_identity
from .opening import LockedStore, StoreView
from .shardfile import default_copiers, save_columns, shared_mode, sync_file
from .stats import HEADER_KEY, PointStats, Workspace, header_text

_STOP = object()


@dataclasses.dataclass(frozen=True)
class QueuedBatch:
    """A batch `write` queued for the writer thread."""

    index: int
    columns: dict[str, torch.Tensor]  # activations and meta columns, on the host (or being copied there)
    points: tuple[str, ...]  # the activations among them, in the order the manifest's stats follow
    given: dict[str, PointStats]  # the points' statistics the caller computed
    measured: Future | None  # the others', being measured on the stats thread (or None: measured later)
    handoff: Handoff | None  # the copy still filling `columns`, and their memory's release


class ShardWriter:
    """Append batches of per-token rows to the store at `out_dir`, resuming it if it exists.

    `write(i, tensors, meta)` queues batch `i` (a bounded queue: the caller blocks when the disk
    falls behind, so memory stays flat); `close()` flushes the rest and reports any error from the
    writer thread. Under torchrun each rank writes `shard-r{rank:03d}-*` files and its own
    `manifest.rank{rank}.json`, writes the batches for which `owns(i)` is true (`i % world_size ==
    rank` in a fresh store), and rank 0 calls `merge_rank_manifests` once every rank has closed.
    Opening a store started with another number of ranks begins a new attempt ("generation" g >= 1:
    files `shard-g{g:03d}-r{rank:03d}-*`, `manifest.rank{rank}.gen{g}.json`) that deals the batches
    no one has committed; `done_batches` are those to skip.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        settings: dict[str, Any],
        *,
        shard_rows: int = 65536,
        queue_size: int = 4,
        rank: int = 0,
        world_size: int = 1,
        checksum: str = WRITTEN,
        writers: int | None = None,
        opened: StoreView | None = None,
    ):
        _check_options(shard_rows, queue_size, rank, world_size, checksum)
        store = LockedStore.open(out_dir, settings, rank, world_size, opened)  # store/opening.py
        self.fs = store.fs
        self.out = store.fs.url
        self.rank = rank
        self.world_size = world_size
        self.shard_rows = shard_rows
        self.checksum = checksum
        self.deal = store.plan.deal
        self.generation = store.plan.deal.generation
        self._prefix = store.prefix
        self._staging = store.staging
        self._bounce = store.bounce
        self._manifest_name = store.manifest_name
        self._file_mode = shared_mode()  # safetensors creates 0600 files; a store is meant to be shared
        self._layout = store.layout  # every rank's batches must match the store's columns
        self._next_shard = store.next_shard
        self._last_batch: int | None = None
        self._error: BaseException | None = None
        self._error_reported = False
        self._closed = False
        self._discard_partial = False  # set on an interrupt: the final, partial shard is not written
        # the batches waiting to become the next shard; only the writer thread touches them
        self._pending: list[tuple[int, dict[str, torch.Tensor]]] = []
        self._handoffs: list[Handoff] = []  # of the pending batches: released once written
        self._pending_stats: dict[str, PointStats] = {}
        self._pending_rows = 0
        self.busy_seconds = 0.0  # the writer thread's time spent writing shards, for a run's report
        self._work = Workspace()  # the statistics' float32 chunk of rows, reused (by `_measure`)
        self._measurer = ThreadPoolExecutor(1, thread_name_prefix="hookscope-shard-stats")
        # copies a shard's bytes into its file while the writer thread checksums them (shardfile.py)
        self._copiers = ThreadPoolExecutor(writers or default_copiers(), "hookscope-shard-copy")
        # a shard's fsync, rename and commit, while the next shard is written (store/committer.py)
        self._committer = Committer(store.fs, store.commits, store.manifest, store.done)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._run, name="hookscope-shard-writer", daemon=True)
        self._thread.start()

    # -- the caller's side ------------------------------------------------------------------------

    @property
    def manifest(self) -> Manifest:
        """This writer's manifest as last committed."""
        return self._committer.manifest

    @property
    def done_batches(self) -> set[int]:
        """The batches to skip: committed by earlier attempts, by this rank before, or by this writer."""
        return self._committer.done_batches

    @property
    def bytes_written(self) -> int:
        """Bytes of the shards this writer committed, for a progress bar."""
        return self._committer.bytes_written

    @property
    def total_rows(self) -> int:
        """Rows committed to this writer's manifest (including those from earlier runs)."""
        return self.manifest.rows

    @property
    def nonfinite(self) -> dict[str, int]:
        """NaN/Inf values per point, committed so far."""
        return {name: s.nonfinite for name, s in self.manifest.stats.items()}

    def owns(self, batch_index: int) -> bool:
        """Whether this writer is to write batch `batch_index` (not done, and dealt to this rank)."""
        return batch_index not in self.done_batches and self.deal.owner(batch_index) == self.rank

    def write(
        self,
        batch_index: int,
        tensors: Mapping[str, torch.Tensor],
        meta: Mapping[str, torch.Tensor] | None = None,
        *,
        stats: Mapping[str, PointStats] | None = None,
        handoff: Handoff | None = None,
    ) -> None:
        """Queue batch `batch_index`: `tensors` are activations [rows, ...], `meta` integer [rows]
        columns (token_ids, doc_ids, positions, seq_ids). `stats`: each point's `PointStats.of` its
        tensor, computed by the caller where the activations were (on a GPU, before the copy to the
        host); the writer computes those not given. `handoff`: the tensors are still being filled
        (a copy from a device): the writer thread waits on it before reading them, takes the
        statistics it gives, and releases it once they are written. The writer owns the tensors
        afterwards: do not modify them in place."""
        self._raise_if_failed()
        if self._closed:
            raise StoreError("write() after close()")
        self._check_index(batch_index)
        if not tensors:
            raise StoreError(f"batch {batch_index}: no activation tensors given")
        batch = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        for name, v in (meta or {}).items():
            if name in batch:
                raise StoreError(f"batch {batch_index}: {name!r} is both an activation and a meta column")
            if v.dim() != 1 or v.dtype.is_floating_point or v.dtype == torch.bool:
                raise StoreError(f"batch {batch_index}: meta column {name!r} must be a 1-D integer tensor")
            batch[name] = v.detach().to("cpu", torch.int64).contiguous()
        self._check_layout(batch_index, batch)
        if extra := set(stats or {}) - set(tensors):
            raise StoreError(f"batch {batch_index}: stats given for {sorted(extra)}, not activations of it")
        self._last_batch = batch_index
        given = dict(stats or {})
        todo = {name: batch[name] for name in tensors if name not in given}
        ready = handoff is None or handoff.ready  # else measured once its copy is done
        measured = self._measure(todo) if todo and ready else None
        # a tuple, not a set: the manifest's stats follow this order, the same in every process
        self._queue.put(QueuedBatch(batch_index, batch, tuple(tensors), given, measured, handoff))

    def _measure(self, tensors: dict[str, torch.Tensor]) -> Future:
        """Each tensor's `PointStats` on the stats thread: beside the shard before's copy, not after it."""
        return self._measurer.submit(lambda: {k: PointStats.of(v, self._work) for k, v in tensors.items()})

    def close(self) -> None:
        """Write the remaining rows as a final shard, stop the thread, raise any writer error."""
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join()
        self._raise_if_failed()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.close()
            return
        if isinstance(exc, KeyboardInterrupt):
            # Ctrl-C / SIGTERM: commit only the shards an uninterrupted run would cut, and drop the
            # rest of the unfinished one; the resume recomputes it and the store comes out identical.
            self._discard_partial = True
        try:  # otherwise still flush the whole batches queued before the failure: nothing finished is lost
            self.close()
        except StoreError as e:  # keep the caller's exception the one reported
            exc.add_note(f"and the store writer failed too: {e}")

    def _check_index(self, i: int) -> None:
        if i in self.done_batches:
            raise StoreError(f"batch {i} is already in the store; skip the batches in writer.done_batches")
        if self.deal.owner(i) != self.rank:
            raise StoreError(
                f"batch {i} belongs to rank {self.deal.owner(i)}, not to this writer "
                f"(rank {self.rank}); write the batches for which owns(i) is true"
            )
        if self._last_batch is not None and i <= self._last_batch:
            raise StoreError(f"batch {i} after batch {self._last_batch}: write batches in increasing order")

    def _check_layout(self, i: int, batch: dict[str, torch.Tensor]) -> None:
        rows = {v.shape[0] if v.dim() else None for v in batch.values()}
        if len(rows) != 1 or None in rows:
            raise StoreError(
                f"batch {i}: every tensor needs the same first (rows) dimension, got "
                + ", ".join(f"{k} {tuple(v.shape)}" for k, v in batch.items())
            )
        layout = {
            k: Column(tuple(v.shape[1:]), str(v.dtype).removeprefix("torch.")) for k, v in batch.items()
        }
        if not self._layout:
            self._layout = layout
            return
        if layout != self._layout:
            had = ", ".join(f"{k} {c.shape} {c.dtype}" for k, c in sorted(self._layout.items()))
            got = ", ".join(f"{k} {c.shape} {c.dtype}" for k, c in sorted(layout.items()))
            raise StoreError(f"batch {i} has columns [{got}] but the store holds [{had}]")

    def _raise_if_failed(self) -> None:
        if self._error is not None and not self._error_reported:
            self._error_reported = True
            m = self.manifest
            if self.fs.size(self._manifest_name) is None:  # stamped at open: gone means the directory went
                raise StoreError(
                    f"the store directory {self.out} was deleted (or unmounted) while it was being written "
                    f"({self._error!r}); the rows it held are gone. Re-run the same command to start over."
                ) from self._error
            raise StoreError(
                f"writing the store {self.out} failed: {self._error!r}. The {m.rows:,} rows in "
                f"{len(m.shards)} shards already committed are intact; fix the cause (e.g. free disk "
                "space) and re-run the same command to resume."
            ) from self._error

    # -- the writer thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._finish()
                return
            if self._error is None:  # after an error, keep draining so that write() never blocks
                self._guard(self._take, item)
            if self._error is not None:
                self._release(item.handoff)

    def _finish(self) -> None:
        """At close: the last shard written and committed (unless dropped or failed), the threads
        stopped, the manifest compacted, the store unlocked and the staging directory gone."""
        if self._pending and self._error is None and not self._discard_partial:
            self._guard(self._flush)
        self._release()  # a partial shard dropped, or a failed one: nothing reads them now
        started = time.perf_counter()
        self._guard(self._committer.settle)  # the last shard's commit, before the staging goes
        self.busy_seconds += time.perf_counter() - started
        self._copiers.shutdown()
        self._committer.shutdown()
        self._measurer.shutdown(cancel_futures=True)
        if self._error is None:
            self._guard(self._committer.finish)
        self._committer.unlock()
        self.fs.done_staging(self._staging)
        self._work = Workspace()  # its memory back

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - any failure is handed to the caller at its next write() / close()
            self._error = self._error or e  # the first failure is the one reported

    def _take(self, queued: QueuedBatch) -> None:
        """Add a queued batch to the pending shard (its statistics too), and write the shard once it
        holds `shard_rows` rows."""
        if self._pending and (
            self.deal.position(queued.index) != self.deal.position(self._pending[-1][0]) + self.world_size
        ):
            self._flush()  # a batch of this rank was left out: a shard holds an unbroken run of them
        batch = queued.columns
        given = queued.given
        if queued.handoff is not None:
            self._handoffs.append(queued.handoff)
            given = {**given, **queued.handoff.wait()}  # the batch's bytes are on the host from here
        if queued.measured is not None:
            given = {**given, **queued.measured.result()}
        if missing := {
            name: batch[name] for name in queued.points if name not in given
        }:  # copied from a device
            given = {**given, **self._measure(missing).result()}
        self._pending.append((queued.index, batch))
        for name in queued.points:
            self._pending_stats[name] = self._pending_stats.get(name, PointStats()).merge(given[name])
        self._pending_rows += next(iter(batch.values())).shape[0]
        if self._pending_rows >= self.shard_rows:
            self._flush()

    def _flush(self) -> None:
        started = time.perf_counter()
        self._write_shard(self._pending, self._pending_stats)
        # their buffers are back already
        self._pending = []
        self._pending_stats = {}
        self._pending_rows = 0
        self.busy_seconds += time.perf_counter() - started

    def _release(self, *more: Handoff | None) -> None:
        """Hand back the memory of the pending batches (and `more`): nothing reads it any more."""
        for handoff in [*self._handoffs, *more]:
            if handoff is not None:
                handoff.release()
        self._handoffs = []

    def _write_shard(
        self, pending: list[tuple[int, dict[str, torch.Tensor]]], stats: dict[str, PointStats]
    ) -> None:
        # each column as its batches: written one after the other, never concatenated into a copy
        columns = {k: [b[k] for _, b in pending] for k in pending[0][1]}
        name = f"{self._prefix}{self._next_shard:06d}.safetensors"
        self._next_shard += 1
        tmp = self._staging / (name + ".tmp")
        runs = runs_of([i for i, _ in pending])
        # the identity, then the per-dimension statistics (the manifest keeps their scalars), each
        # text deterministic: the shard's bytes are the same from run to run
        metadata = {
            **shard_identity(self.manifest.settings_hash, runs, self.rank),
            HEADER_KEY: header_text(stats),
        }
        try:
            self._staging.mkdir(exist_ok=True)  # made on the first write: a store never written has none
            size, digest = save_columns(
                columns,
                tmp,
                metadata,
                self.checksum,
                self._copiers,
                self._file_mode,
                sync=False,
                bounce=self._bounce,
            )
            # the batches' bytes are in the file: their buffers go back now, not after the wait below,
            # so that the next batches' copies reuse them instead of pinning new ones meanwhile
            self._release()
            self._committer.wait()  # the shard before: committed first (or failed, and this one goes too)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        rows = sum(b[next(iter(b))].shape[0] for _, b in pending)
        scalars = {k: s.scalars() for k, s in stats.items()}
        entry = ShardEntry(
            f"{SHARDS_DIR}/{name}",
            rows,
            digest,
            size,
            runs,
            self.rank,
            self.generation,
            scalars,
            algorithm=self.checksum,
        )
        self._committer.start(self._put_and_commit, tmp, entry, scalars)

    def _put_and_commit(self, tmp: Path, entry: ShardEntry, stats: dict[str, PointStats]) -> None:
        """On the commit thread: shard file `tmp`, written, becomes durable, takes its place, and is
        committed."""
        try:
            sync_file(tmp)  # raises the fsync's error (a full disk): the shard is not durable
            # renamed, or uploaded under its final name: on an object store the manifest PUT commits it
            self.fs.put_file(tmp, entry.file)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._committer.commit(entry, self._layout, stats, last_try=False)


def _check_options(shard_rows: int, queue_size: int, rank: int, world_size: int, checksum: str) -> None:
    """Refuse a writer's settings out of range, before the store is touched."""
    if shard_rows < 1 or queue_size < 1:
        raise StoreError(f"shard_rows ({shard_rows}) and queue_size ({queue_size}) must be >= 1")
    if not 0 <= rank < world_size:
        raise StoreError(f"rank {rank} is outside world_size {world_size}")
    if checksum not in ALGORITHMS:
        raise StoreError(f"checksum={checksum!r}: use one of {', '.join(ALGORITHMS)}")
