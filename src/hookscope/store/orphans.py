"""What a crashed writer leaves in a store, found by name and deleted when the next writer opens."""

from __future__ import annotations

import re

from .fs import FS
from .manifest import SHARDS_DIR

# safetensors' save_file writes `.tmp` + 6 letters or digits beside its target, then renames it
_LIBRARY_TEMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")


def remove_orphans(
    fs: FS,
    rank: int,
    generation: int,
    prefix: str,
    listed: set[str],
    manifest_name: str,
    found_at_open: list[str],
) -> None:
    """Delete leftovers of a crash: this rank's staging directory (a half-written shard and any
    temporary file safetensors made beside it), `.tmp` files and the shards no manifest lists
    (`listed`: file names), and (rank 0) those of earlier attempts, whose processes have stopped,
    and safetensors' temporary files in shards/ itself (only writers before the staging
    directories left them); and this writer's manifest's cut-short `.tmp`."""

    def debris(name: str) -> bool:
        if rank == 0 and _LIBRARY_TEMP.fullmatch(name):
            return True
        if not name.startswith(prefix) and (
            rank != 0 or not name.startswith("shard-") or _of_generation(name, generation)
        ):
            return False  # another rank's of this attempt: it may be writing it right now
        return name.endswith(".tmp") or name not in listed

    for name in fs.list(SHARDS_DIR):
        if debris(name):
            fs.remove(f"{SHARDS_DIR}/{name}")
    if manifest_name + ".tmp" in found_at_open:  # a local manifest write cut short
        fs.remove(manifest_name + ".tmp")


def _of_generation(name: str, generation: int) -> bool:
    """Whether shard file `name` was written by attempt `generation`."""
    return bool(re.match(r"shard-r\d{3}-" if generation == 0 else rf"shard-g{generation:03d}-", name))
