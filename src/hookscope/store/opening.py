"""A store as a run finds it, read once (`StoreView`): the extraction loop reads it before its first
batch (which batches to skip) and hands it to the writer, which then only checks that no other run
wrote since, by listing the directory, instead of reading every manifest again."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..errors import StoreError
from .card import CARD
from .fs import open_fs
from .manifest import SHARDS_DIR, manifest_name
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
