"""Write a store: a background thread turns batches into safetensors shards while the caller computes.

Crash safety rests on three rules. A shard is written under a `.tmp` name, fsynced and renamed;
the manifest is then replaced atomically; and a batch counts as done only once the manifest lists
the shard holding it. Shards are cut at batch boundaries only, so every committed shard holds whole
batches, and a resumed run that skips `done_batches` writes each batch exactly once. Because the
cut points depend only on the sequence of batches, a resumed store equals an uninterrupted one
shard for shard.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import re
import shutil
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

import torch
from safetensors.torch import save_file

from ..errors import StoreError
from .card import CARD, card_bytes, write_card
from .fs import Remote, is_remote, local_path, sha256_of
from .manifest import (
    MANIFEST,
    SHARDS_DIR,
    Column,
    Manifest,
    PointStats,
    ShardEntry,
    fsync_dir,
    manifest_name,
    settings_diff,
    shard_identity,
)

_STOP = object()


class ShardWriter:
    """Append batches of per-token rows to the store at `out_dir`, resuming it if it exists.

    `write(i, tensors, meta)` queues batch `i` (a bounded queue: the caller blocks when the disk
    falls behind, so memory stays flat); `close()` flushes the rest and reports any error from the
    writer thread. Under torchrun each rank writes `shard-r{rank:03d}-*` files and its own
    `manifest.rank{rank}.json`, owns the batches with `i % world_size == rank`, and rank 0 calls
    `merge_rank_manifests` once every rank has closed.
    """

    def __init__(self, out_dir: str | os.PathLike, settings: dict[str, Any], *, shard_rows: int = 65536,
                 queue_size: int = 4, rank: int = 0, world_size: int = 1):
        if shard_rows < 1 or queue_size < 1:
            raise StoreError(f"shard_rows ({shard_rows}) and queue_size ({queue_size}) must be >= 1")
        if not 0 <= rank < world_size:
            raise StoreError(f"rank {rank} is outside world_size {world_size}")
        # a URL: shards are staged in a local directory, uploaded, then committed by the manifest PUT
        self._remote = Remote(os.fspath(out_dir)) if is_remote(out_dir) else None
        self.out = self._remote.url if self._remote else local_path(out_dir)
        self.rank, self.world_size, self.shard_rows = rank, world_size, shard_rows
        self._staging = Path(tempfile.mkdtemp(prefix="hookscope-stage-", dir=os.environ.get(
            "HOOKSCOPE_STAGING_DIR"))) if self._remote else None
        self._shards = self._staging if self._remote else self.out / SHARDS_DIR
        self._file_mode = 0o666 & ~_umask()  # safetensors creates 0600 files; a store is meant to be shared
        self._prefix = f"shard-r{rank:03d}-"
        self._manifest_name = manifest_name(rank, world_size)
        self._manifest_path = Path(self.out) / self._manifest_name
        self._check_is_store_dir()
        try:
            self._shards.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create the store directory {self.out}: {e}; "
                             "choose a writable --out") from e
        self.manifest = self._open_manifest(settings)
        try:  # stamps the settings into the directory now, and proves it is writable before any compute
            self._remove_orphans()
            self._save_manifest(self.manifest)
            # README.md: datasets.load_dataset(DIR) fails clearly rather than misreading the store
            if self._remote is None:
                write_card(self.out)
            elif self._remote.size(CARD) is None:
                self._remote.write(CARD, card_bytes())
        except OSError as e:
            raise StoreError(f"cannot write to the store directory {self.out}: {e}; make it writable (or "
                             "free space) or choose another --out, and re-run") from e
        self.done_batches: frozenset[int] = frozenset(self.manifest.done_batches(rank))
        self.bytes_written = 0  # this session, for a progress bar
        self._layout: dict[str, Column] = self.manifest.columns
        self._next_shard = 1 + max((_shard_number(s.file) for s in self.manifest.shards if s.rank == rank),
                                   default=-1)
        self._last_batch: int | None = None
        self._error: BaseException | None = None
        self._error_reported = False
        self._closed = False
        self._discard_partial = False  # set on an interrupt: the final, partial shard is not written
        # the batches waiting to become the next shard; only the writer thread touches them
        self._pending: list[tuple[int, dict[str, torch.Tensor]]] = []
        self._pending_stats: dict[str, PointStats] = {}
        self._pending_rows = 0
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._run, name="hookscope-shard-writer", daemon=True)
        self._thread.start()

    # -- the caller's side ------------------------------------------------------------------------

    @property
    def total_rows(self) -> int:
        """Rows committed to this writer's manifest (including those from earlier runs)."""
        return self.manifest.rows

    @property
    def nonfinite(self) -> dict[str, int]:
        """NaN/Inf values per point, committed so far."""
        return {name: s.nonfinite for name, s in self.manifest.stats.items()}

    def write(self, batch_index: int, tensors: Mapping[str, torch.Tensor],
              meta: Mapping[str, torch.Tensor] | None = None) -> None:
        """Queue batch `batch_index`: `tensors` are activations [rows, ...], `meta` integer [rows]
        columns (token_ids, doc_ids, positions, seq_ids). The writer owns the tensors afterwards:
        do not modify them in place."""
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
        self._last_batch = batch_index
        # a tuple, not a set: the manifest's stats follow this order, the same in every process
        self._queue.put((batch_index, batch, tuple(tensors)))

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
        if i % self.world_size != self.rank:
            raise StoreError(f"batch {i} belongs to rank {i % self.world_size}, "
                             f"not to this writer (rank {self.rank})")
        if i in self.done_batches:
            raise StoreError(f"batch {i} is already in the store; skip the batches in writer.done_batches")
        if self._last_batch is not None and i <= self._last_batch:
            raise StoreError(f"batch {i} after batch {self._last_batch}: write batches in increasing order")

    def _check_layout(self, i: int, batch: dict[str, torch.Tensor]) -> None:
        rows = {v.shape[0] if v.dim() else None for v in batch.values()}
        if len(rows) != 1 or None in rows:
            raise StoreError(f"batch {i}: every tensor needs the same first (rows) dimension, got "
                             + ", ".join(f"{k} {tuple(v.shape)}" for k, v in batch.items()))
        layout = {k: Column(tuple(v.shape[1:]), str(v.dtype).removeprefix("torch."))
                  for k, v in batch.items()}
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
            if not self._manifest_exists():  # stamped at open: gone means the directory went
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
                if self._pending and self._error is None and not self._discard_partial:
                    self._guard(self._flush)
                if self._staging is not None:
                    shutil.rmtree(self._staging, ignore_errors=True)
                return
            if self._error is None:  # after an error, keep draining so that write() never blocks
                self._guard(self._take, *item)

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - any failure is handed to the caller at its next write() / close()
            self._error = e

    def _take(self, index: int, batch: dict[str, torch.Tensor], points: tuple[str, ...]) -> None:
        if self._pending and index != self._pending[-1][0] + self.world_size:
            self._flush()  # a gap in the batch indices: each shard covers one unbroken run of batches
        self._pending.append((index, batch))
        for name in points:
            self._pending_stats[name] = self._pending_stats.get(name, PointStats()).merge(
                PointStats.of(batch[name]))
        self._pending_rows += next(iter(batch.values())).shape[0]
        if self._pending_rows >= self.shard_rows:
            self._flush()

    def _flush(self) -> None:
        self._write_shard(self._pending, self._pending_stats)
        self._pending, self._pending_stats, self._pending_rows = [], {}, 0

    def _write_shard(self, pending: list[tuple[int, dict[str, torch.Tensor]]],
                     stats: dict[str, PointStats]) -> None:
        tensors = {k: torch.cat([b[k] for _, b in pending]) for k in pending[0][1]}
        name = f"{self._prefix}{self._next_shard:06d}.safetensors"
        final, tmp = self._shards / name, self._shards / (name + ".tmp")
        identity = shard_identity(self.manifest.settings_hash, pending[0][0], pending[-1][0], self.rank)
        try:
            save_file(tensors, tmp, metadata=identity)
            os.chmod(tmp, self._file_mode)
            size, sha = _fsync_and_hash(tmp)
            if self._remote:  # no rename on an object store: the manifest PUT below commits it
                self._remote.upload(tmp, f"{SHARDS_DIR}/{name}")
                tmp.unlink()
            else:
                os.replace(tmp, final)
                fsync_dir(self._shards)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        rows = next(iter(tensors.values())).shape[0]
        entry = ShardEntry(f"{SHARDS_DIR}/{name}", rows, sha, size, pending[0][0], pending[-1][0], self.rank)
        old = self.manifest
        merged = {k: old.stats.get(k, PointStats()).merge(s) for k, s in stats.items()}
        new = dataclasses.replace(
            old, shards=[*old.shards, entry], stats={**old.stats, **merged},
            points={k: c for k, c in self._layout.items() if k in stats},
            meta={k: c for k, c in self._layout.items() if k not in stats},
        )
        try:
            self._save_manifest(new)
        except BaseException:
            # not committed: free its space; a resume would delete it anyway
            self._remote.remove(entry.file) if self._remote else final.unlink(missing_ok=True)
            raise
        self.manifest = new  # rebinding, so the caller's thread always sees a whole manifest
        self.done_batches = self.done_batches | set(entry.batches(self.world_size))
        self.bytes_written += size
        self._next_shard += 1

    # -- opening ----------------------------------------------------------------------------------

    def _check_is_store_dir(self) -> None:
        if self._remote:
            names = self._remote.list()
        elif self.out.is_dir():
            names = [p.name for p in self.out.iterdir()]
        else:
            return
        foreign = [n for n in names if n != SHARDS_DIR and not n.startswith("manifest")]
        has_manifest = any(_is_manifest(n) for n in names)
        if foreign and not has_manifest:
            raise StoreError(f"{self.out} is not empty and is not a hookscope store "
                             f"(it holds {sorted(foreign)[:5]}); choose a new or empty --out directory")

    def _manifests(self) -> list[tuple[str, Manifest]]:
        """Every manifest in the store (ours, the merged one, other ranks'), by name."""
        if self._remote:
            names = [n for n in self._remote.list() if _is_manifest(n)]
            return [(n, Manifest.from_bytes(self._remote.read(n), f"{self.out}/{n}")) for n in names]
        return [(p.name, Manifest.load(p)) for p in sorted(self.out.glob("manifest*.json"))]

    def _manifest_exists(self) -> bool:
        if self._remote:
            return self._remote.size(self._manifest_name) is not None
        return self._manifest_path.exists()

    def _save_manifest(self, manifest: Manifest) -> None:
        if self._remote:
            self._remote.write(self._manifest_name, manifest.to_bytes())  # one PUT: the commit point
        else:
            manifest.save(self._manifest_path)

    def _open_manifest(self, settings: dict[str, Any]) -> Manifest:
        fresh = Manifest(settings=settings, world_size=self.world_size)
        existing = None
        for name, m in self._manifests():
            if m.settings_hash != fresh.settings_hash:
                diff = "\n  ".join(settings_diff(m.settings, fresh.settings))
                raise StoreError(
                    f"{self.out} already holds a store made with different settings:\n  {diff}\n"
                    f"Use a new --out directory, or delete {self.out} to start over."
                )
            if m.world_size != self.world_size:
                raise StoreError(f"{self.out} was written by {m.world_size} process(es), "
                                 f"not {self.world_size}; resume with the same number of processes, "
                                 "or use a new --out directory")
            if name == self._manifest_name:
                existing = m
        return existing or fresh

    def _remove_orphans(self) -> None:
        """Delete this rank's leftovers of a crash: `.tmp` files and shards the manifest never listed."""
        listed = {Path(s.file).name for s in self.manifest.shards}
        if self._remote:
            for name in self._remote.list(SHARDS_DIR):
                if name.startswith(self._prefix) and name not in listed:
                    self._remote.remove(f"{SHARDS_DIR}/{name}")
            return
        for path in self._shards.glob(self._prefix + "*"):
            if path.name.endswith(".tmp") or path.name not in listed:
                path.unlink(missing_ok=True)
        self._manifest_path.with_name(self._manifest_path.name + ".tmp").unlink(missing_ok=True)


def _is_manifest(name: str) -> bool:
    return name.startswith("manifest") and name.endswith(".json")


def merge_rank_manifests(out_dir: str | os.PathLike, world_size: int) -> Manifest:
    """Merge every rank's `manifest.rank{r}.json` into `manifest.json` (rank 0, after a barrier)."""
    remote = Remote(os.fspath(out_dir)) if is_remote(out_dir) else None
    out = remote.url if remote else local_path(out_dir)
    if remote:
        names = [manifest_name(r, world_size) for r in range(world_size)]
        parts = [Manifest.from_bytes(remote.read(n), f"{out}/{n}") for n in names]
    else:
        parts = [Manifest.load(out / manifest_name(r, world_size)) for r in range(world_size)]
    if world_size == 1:
        return parts[0]
    if len({m.settings_hash for m in parts}) != 1:
        raise StoreError(f"{out}: the ranks' manifests were written with different settings; "
                         "re-run all ranks")
    layouts = {(tuple(m.points.items()), tuple(m.meta.items())) for m in parts if m.shards}
    if len(layouts) > 1:
        raise StoreError(f"{out}: the ranks wrote different columns (points, shapes or dtypes)")
    with_rows = next((m for m in parts if m.shards), parts[0])
    stats: dict[str, PointStats] = {}
    for m in parts:
        for k, s in m.stats.items():
            stats[k] = stats.get(k, PointStats()).merge(s)
    merged = Manifest(settings=parts[0].settings, world_size=world_size, points=with_rows.points,
                      meta=with_rows.meta, shards=sorted((s for m in parts for s in m.shards),
                                                         key=lambda s: (s.batch_start, s.rank)),
                      stats=stats, settings_hash=parts[0].settings_hash)
    if remote:
        remote.write(MANIFEST, merged.to_bytes())
    else:
        merged.save(out / MANIFEST)
    return merged


def _umask() -> int:
    mask = os.umask(0)  # reading the umask means setting it: put it straight back (main thread, at open)
    os.umask(mask)
    return mask


def _shard_number(file: str) -> int:
    m = re.search(r"-(\d+)\.safetensors$", file)
    return int(m.group(1)) if m else -1


def _fsync_and_hash(path: Path) -> tuple[int, str]:
    with open(path, "rb") as f:
        size, digest = sha256_of(f)
        os.fsync(f.fileno())
    return size, digest
