"""A store as a run finds it, read once (`StoreView`): the extraction loop reads it before its first
batch (which batches to skip) and hands it to the writer, which then only checks that no other run
wrote since, by listing the directory, instead of reading every manifest again. And a store opened
for one writer (`LockedStore.open`): checked, locked against a second run, cleared of what a crash
left, its manifest stamped; the writer starts from there."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..errors import StoreError
from . import direct
from .card import CARD
from .fs import FS, open_fs
from .journal import Commits
from .manifest import (
    SHARDS_DIR,
    Column,
    Manifest,
    manifest_name,
    shard_number,
    shard_prefix,
    summed_stats,
)
from .orphans import remove_orphans
from .resume import Plan, is_manifest, plan, read_manifests


@dataclasses.dataclass(frozen=True)
class StoreView:
    """A store as one read at the start of a run finds it: the names in its directory, the sizes of
    its files there (its manifests), and the plan (which batches this rank skips, the deal). The
    extraction loop reads it once before its first batch and hands it to the writer, which only
    checks, by a listing, that no other run wrote since (`changed`)."""

    names: list[str]
    sizes: dict[str, int]
    plan: Plan
    rank: int = 0

    @classmethod
    def read(cls, location: Any, settings: dict[str, Any], world_size: int, rank: int = 0) -> StoreView:
        fs = location if hasattr(location, "sizes") else open_fs(location)
        names = store_names(fs)
        sizes = fs.sizes()
        found = plan(read_manifests(fs), settings, world_size, fs.url)
        return cls(names, sizes, found, rank)

    def changed(self, fs: Any) -> bool:
        """Whether a file this rank's plan rests on was added, removed or rewritten since the read.
        The other ranks of this attempt stamp and extend their own manifests meanwhile, and rank 0
        puts the store card: not a change."""
        deal = self.plan.deal
        theirs = {manifest_name(r, deal.world_size, deal.generation) for r in range(deal.world_size)} - {
            manifest_name(self.rank, deal.world_size, deal.generation)
        }

        def mine(sizes: dict[str, int]) -> dict[str, int]:
            # theirs: their manifests, and the files named after them (.tmp, journal, lock)
            return {
                k: v
                for k, v in sizes.items()
                if k not in (CARD, CARD + ".tmp")
                and k not in theirs
                and not any(k.startswith(t.removesuffix(".json") + ".") for t in theirs)
            }

        return mine(fs.sizes()) != mine(self.sizes)


def store_names(fs: Any) -> list[str]:
    """What the store directory holds (refused if it holds something other than a store)."""
    names = fs.list()
    foreign = [n for n in names if n != SHARDS_DIR and not n.startswith("manifest")]
    if foreign and not any(is_manifest(n) for n in names):
        raise StoreError(
            f"{fs.url} is not empty and is not a hookscope store "
            f"(it holds {sorted(foreign)[:5]}); choose a new or empty --out directory"
        )
    return names


@dataclasses.dataclass(frozen=True)
class LockedStore:
    """A store opened for the writer of rank `rank`: what `open` found, and what it made ready.
    Nobody else writes this writer's manifest while `commits` holds its lock."""

    fs: FS
    plan: Plan
    rank: int
    prefix: str  # of this writer's shard files: shard-r000- (shard-g001-r000- in a later attempt)
    staging: Path  # where a shard is written before it counts (see orphans.py)
    bounce: direct.Bounce | None  # the copy around the page cache, where it is wanted (direct.py)
    manifest_name: str
    manifest: Manifest  # what this writer starts from, already written to `manifest_name`
    commits: Commits  # the journal of `manifest_name`, locked

    @classmethod
    def open(
        cls,
        out_dir: Any,
        settings: dict[str, Any],
        rank: int,
        world_size: int,
        view: StoreView | None = None,
    ) -> LockedStore:
        """Open the store at `out_dir` for rank `rank`'s writer: read it (or check that nothing
        changed since `view` was read), make the staging directory, take the lock, delete what a
        crashed writer left, stamp the settings into the manifest and put the store card. Raises
        StoreError, naming the fix, when any of it fails; the lock is then let go."""
        fs = open_fs(out_dir)
        view = _unchanged(fs, view) if view is not None else StoreView.read(fs, settings, world_size, rank)
        found = view.plan
        generation = found.deal.generation
        prefix = shard_prefix(rank, generation)
        owner = f"{prefix}writing"
        try:  # a directory of this writer's own, named with its shard prefix, inside shards/ (or a
            # local one for a URL); see orphans.py
            staging = fs.staging(SHARDS_DIR, owner)
        except OSError as e:
            raise StoreError(
                f"cannot create the store directory {fs.url}: {e}; choose a writable --out"
            ) from e
        # around the page cache on a disk's filesystem (direct.py); a URL's staged files are read back
        bounce = direct.Bounce() if not fs.remote and direct.wanted(staging) else None
        name = manifest_name(rank, world_size, generation)
        manifest = _starting_manifest(found, settings, rank, world_size)
        commits = Commits(fs, name, puts_card=rank == 0)  # store/journal.py
        try:  # stamps the settings into the directory now, and proves it is writable before any compute
            commits.lock()  # before anything is touched: a second run on the store is refused
            listed = {Path(s.file).name for s in found.shards}  # by any manifest: not debris
            remove_orphans(fs, rank, generation, prefix, listed, name, view.names)
            fs.remove_stale_staging(owner, staging)
            commits.open(manifest, found.manifests.get(name))
            # README.md: datasets.load_dataset(DIR) fails clearly rather than misreading the store
            if fs.size(CARD) is None:
                commits.put_card()
        except OSError as e:
            commits.unlock()  # refused: the next try, in this process too, may take the store
            raise StoreError(
                f"cannot write to the store directory {fs.url}: {e}; make it writable (or "
                "free space) or choose another --out, and re-run"
            ) from e
        return cls(fs, found, rank, prefix, staging, bounce, name, manifest, commits)

    @property
    def done(self) -> set[int]:
        """The batches to skip: what earlier attempts committed, and this rank's own shards of this
        attempt (a set of its own: the writer grows it as it commits)."""
        return set(self.plan.done(self.rank))

    @property
    def layout(self) -> dict[str, Column]:
        """The store's columns (none in a new store): every batch written must match them."""
        return {**self.plan.points, **self.plan.meta}

    @property
    def next_shard(self) -> int:
        """The number of this writer's next shard file: one past the last it committed before."""
        return 1 + max((shard_number(s.file) for s in self.plan.own(self.rank)), default=-1)


def _unchanged(fs: FS, view: StoreView) -> StoreView:
    """`view`, read by the caller before its first batch, once checked: nobody may write since."""
    if view.changed(fs):
        raise StoreError(
            f"{fs.url} changed while this run started: is another run writing to it? Stop "
            "every other run on this store and re-run the command"
        )
    return view


def _starting_manifest(found: Plan, settings: dict[str, Any], rank: int, world_size: int) -> Manifest:
    """The manifest a writer starts from. One process keeps the whole store's manifest.json (earlier
    attempts' shards too); a rank of several keeps its own shards only, and the merge unites them."""
    own = found.own(rank)
    shards = sorted([*found.inherited(), *own], key=lambda s: s.batch_start) if world_size == 1 else own
    return Manifest(
        settings=settings,
        world_size=world_size,
        generation=found.deal.generation,
        points=found.points if shards else {},
        meta=found.meta if shards else {},
        shards=shards,
        stats=summed_stats(shards),
    )
