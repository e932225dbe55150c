"""Which batches a store already holds, and which rank writes each of the others (elastic resume).

A store is written by one or more *attempts* (generations 0, 1, 2...). A resume with the world size
of the latest attempt continues it: each rank picks up its own manifest. A resume with another
world size starts the next attempt, which deals the batches that no earlier attempt committed:
the j-th of them (counting up from batch 0, skipping done ones) goes to rank j % world_size.
Every rank of an attempt computes the same deal from the committed manifests alone, without
talking to the others: ranks of the new attempt add only shards of the new generation, which do not
change what was done before it. (The processes of the old attempt must have stopped.)
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import StoreError
from . import meanings
from .fs import FS, open_fs
from .journal import journal_name, load_manifest
from .manifest import (
    MANIFEST,
    VERSION,
    Column,
    Manifest,
    ShardEntry,
    manifest_name,
    settings_diff,
    settings_hash,
    summed_stats,
)


@dataclass(frozen=True)
class Deal:
    """How the `world_size` ranks of attempt `generation` split the batches not done before it."""

    generation: int
    world_size: int
    done_before: tuple[int, ...]  # sorted: the batches committed by earlier attempts

    def __post_init__(self) -> None:
        object.__setattr__(self, "_done", frozenset(self.done_before))

    def position(self, batch: int) -> int:
        """Where `batch` stands among the batches this attempt deals (0 for the first)."""
        return batch - bisect.bisect_left(self.done_before, batch)

    def owner(self, batch: int) -> int | None:
        """The rank that writes `batch`, or None if an earlier attempt did."""
        return None if batch in self._done else self.position(batch) % self.world_size

    def visits(self, batch: int, rank: int) -> bool:
        """Whether `rank` goes through `batch`: it writes it, or (done before) counts it as skipped.
        Every batch is visited by exactly one rank, and batch 0 by rank 0."""
        owner = self.owner(batch)
        return (batch % self.world_size if owner is None else owner) == rank


@dataclass
class Plan:
    """A store's committed state as seen by a new run: every shard, and the deal for this run."""

    deal: Deal
    shards: list[ShardEntry]  # every committed shard of every attempt, by first batch
    points: dict[str, Column]
    meta: dict[str, Column]
    manifests: dict[str, Manifest] = field(default_factory=dict)  # as read, by name, journals applied

    def own(self, rank: int) -> list[ShardEntry]:
        """The shards `rank` of this attempt committed before (when it continues an attempt)."""
        return [s for s in self.shards if s.generation == self.deal.generation and s.rank == rank]

    def inherited(self) -> list[ShardEntry]:
        return [s for s in self.shards if s.generation < self.deal.generation]

    def done(self, rank: int) -> frozenset[int]:
        """The batches `rank` skips: committed by earlier attempts, or by itself in this one."""
        return frozenset(self.deal.done_before).union(*(s.batch_indices() for s in self.own(rank)))


def read_manifests(fs: FS) -> list[tuple[str, Manifest]]:
    """Every manifest in the store (the merged one and every rank's of every attempt), by name."""
    out = []
    for name in fs.list():
        if is_manifest(name):
            try:
                out.append((name, load_manifest(fs, name)))
            except FileNotFoundError:  # renamed away between the listing and the read: not there
                continue
    return out


def is_manifest(name: str) -> bool:
    return name.startswith("manifest") and name.endswith(".json")


def union_shards(manifests: list[tuple[str, Manifest]], where: str) -> list[ShardEntry]:
    """The shards listed by any manifest, by first batch; the same file must be listed the same
    everywhere, and no batch may be in two shards."""
    by_file: dict[str, ShardEntry] = {}
    for name, m in manifests:
        for s in m.shards:
            seen = by_file.setdefault(s.file, s)
            if seen != s:
                raise StoreError(
                    f"{where}: {name} lists {s.file} differently from another manifest; the "
                    "store is damaged. Re-run the extraction into a new directory"
                )
    shards = sorted(by_file.values(), key=lambda s: s.batch_start)
    holder: dict[int, str] = {}
    for s in shards:
        for b in s.batch_indices():
            if holder.setdefault(b, s.file) != s.file:
                raise StoreError(
                    f"{where}: batch {b} is in both {holder[b]} and {s.file}; the store is "
                    "damaged. Re-run the extraction into a new directory"
                )
    return shards


def plan(
    manifests: list[tuple[str, Manifest]], settings: dict[str, Any], world_size: int, where: str
) -> Plan:
    """Check that `manifests` belong to a store made with `settings`, and deal the rest."""
    wanted = settings_hash(settings)
    for name, m in manifests:
        if m.version != VERSION:
            raise StoreError(
                f"{where} was written by an older hookscope (store format {m.version}, in {name}): it opens "
                "for reading, but this version cannot resume or extend it. Finish it with the hookscope "
                "that started it, or use a new --out directory"
            )
        if m.settings_hash != wanted:
            why = meanings.refusal(m.settings, settings, where)
            if why:
                raise StoreError(why)
            diff = "\n  ".join(settings_diff(m.settings, settings))
            raise StoreError(
                f"{where} already holds a store made with different settings:\n  {diff}\n"
                f"Use a new --out directory, or delete {where} to start over."
            )
    shards = union_shards(manifests, where)
    layouts = {(tuple(m.points.items()), tuple(m.meta.items())) for _, m in manifests if m.shards}
    if len(layouts) > 1:
        raise StoreError(
            f"{where}: the manifests hold different columns (points, shapes or dtypes); "
            "the store is damaged. Re-run the extraction into a new directory"
        )
    points, meta = (dict(c) for c in next(iter(layouts))) if layouts else ({}, {})
    latest = max((m.generation for _, m in manifests), default=None)
    if latest is None:
        generation = 0
    else:
        sizes = {m.world_size for _, m in manifests if m.generation == latest}
        if len(sizes) != 1:
            raise StoreError(
                f"{where}: the manifests of attempt {latest} disagree on its number of "
                f"processes ({sorted(sizes)}); the store is damaged"
            )
        generation = latest if sizes == {world_size} else latest + 1
    done_before = sorted(b for s in shards if s.generation < generation for b in s.batch_indices())
    return Plan(Deal(generation, world_size, tuple(done_before)), shards, points, meta, dict(manifests))


def plan_for(out_dir: str | os.PathLike, settings: dict[str, Any], world_size: int) -> Plan:
    """What a writer opening `out_dir` now would find (its deal, the batches it skips), read
    without writing anything."""
    fs = open_fs(out_dir)
    return plan(read_manifests(fs), settings, world_size, fs.url)


def merge_rank_manifests(out_dir: str | os.PathLike, world_size: int | None = None) -> Manifest:
    """Unite every manifest in the store (each rank's, of every attempt) into `manifest.json`: its
    shards ordered by first batch, stats summed. Rank 0 calls it once every rank has closed;
    `world_size`, if given, must be that of the latest attempt."""
    fs = open_fs(out_dir)
    out = fs.url
    manifests = read_manifests(fs)
    if not manifests:
        raise StoreError(f"{out}: no manifest here; is this a hookscope store?")
    latest = max((m for _, m in manifests), key=lambda m: m.generation)
    if world_size is not None and world_size != latest.world_size:
        raise StoreError(f"{out}: its latest run had {latest.world_size} process(es), not {world_size}")
    names = {name for name, _ in manifests}
    missing = [
        r
        for r in range(latest.world_size)
        if manifest_name(r, latest.world_size, latest.generation) not in names
    ]
    if missing:
        raise StoreError(
            f"{out}: rank {missing[0]} of the latest run left no manifest; re-run the job "
            "(it resumes) to finish the store"
        )
    united = plan(manifests, latest.settings, latest.world_size, out)
    merged = Manifest(
        settings=latest.settings,
        world_size=latest.world_size,
        generation=latest.generation,
        points=united.points,
        meta=united.meta,
        shards=united.shards,
        stats=summed_stats(united.shards),
        settings_hash=latest.settings_hash,
    )
    fs.put(MANIFEST, merged.to_bytes())
    fs.remove_tree(journal_name(MANIFEST))  # a single process's commits of an earlier attempt: merged now
    return merged
