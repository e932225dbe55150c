"""Elastic resume at the writer level: a store started by N writers (ranks) and finished by M holds
exactly the rows of one uninterrupted writer; stores of format version 1 still open.

The extraction pipeline's own elastic runs under torchrun are in test_extract.py (local) and
test_store_s3.py (an S3 server)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hookscope.errors import StoreError
from hookscope.store import ShardWriter, merge_rank_manifests, open_store
from hookscope.store.fs import sha256_of
from hookscope.store.resume import Deal

SETTINGS = {"model": "tiny", "points": ["p"], "seed": 0}
N_BATCHES = 30
SHARD_ROWS = 12


def make_batch(i: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Batch i: 3 to 6 rows that depend only on i; column `batch` names the batch of every row."""
    g = torch.Generator().manual_seed(500 + i)
    rows = 3 + i % 4
    acts = {
        "p": torch.randn(rows, 4, generator=g).to(torch.bfloat16),
        "q": torch.randn(rows, 2, 3, generator=g),
    }
    return acts, {"batch": torch.full((rows,), i), "token_ids": torch.randint(0, 999, (rows,), generator=g)}


def write_attempt(out: str, world_size: int, stop_after: list[int | None]) -> None:
    """One attempt of `world_size` writers; rank r is interrupted (as by SIGTERM: whole shards
    kept, the unfinished one dropped) after handing over `stop_after[r]` batches (None: it writes
    all of its own). Each rank opens, writes and closes before the next: they share nothing."""
    for rank in range(world_size):
        try:
            with ShardWriter(out, SETTINGS, shard_rows=SHARD_ROWS, rank=rank, world_size=world_size) as w:
                mine = [i for i in range(N_BATCHES) if w.owns(i)]
                for i in mine[: stop_after[rank]]:
                    w.write(i, *make_batch(i))
                if stop_after[rank] is not None:
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass
    if world_size > 1 and all(n is None for n in stop_after):
        merge_rank_manifests(out)


def in_batch_order(store) -> dict[str, torch.Tensor]:
    """Every column, rows sorted stably by their batch (the store's documented order)."""
    order = torch.sort(store.tensor("batch"), stable=True).indices
    return {name: store.tensor(name)[order] for name in store.manifest.columns}


def same_rows(got, want) -> bool:
    a, b = in_batch_order(got), in_batch_order(want)
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a
    )  # bit for bit


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "store"
    write_attempt(str(out), 1, [None])
    return out


# (world size, batches each rank writes before it stops) per attempt; the last attempt finishes
HISTORIES = {
    "2 -> 1": [(2, [7, 3])],
    "1 -> 2": [(1, [11])],
    "3 -> 2, ragged": [(3, [2, 5, 0])],
    "2 -> 3 -> 1": [(2, [4, 1]), (3, [1, 0, 3])],
    "1 -> 2 -> 2 (same size continues) -> 1": [(1, [5]), (2, [2, 4]), (2, [3, 1])],
}
FINISH = {
    "2 -> 1": 1,
    "1 -> 2": 2,
    "3 -> 2, ragged": 2,
    "2 -> 3 -> 1": 1,
    "1 -> 2 -> 2 (same size continues) -> 1": 1,
}


@pytest.mark.parametrize("history", list(HISTORIES))
@pytest.mark.parametrize("where", ["local", "memory"])
@pytest.mark.slow
def test_finished_by_another_world_size_holds_the_same_rows(tmp_path, reference, history, where):
    out = str(tmp_path / "store") if where == "local" else f"memory://elastic/{tmp_path.name}"
    for world_size, stops in HISTORIES[history]:
        write_attempt(out, world_size, stops)
    finish = FINISH[history]
    write_attempt(out, finish, [None] * finish)
    got, want = open_store(out, verify=True), open_store(reference)
    assert len(got) == len(want) and same_rows(got, want)
    shards = got.manifest.shards
    assert [s.batch_start for s in shards] == sorted(s.batch_start for s in shards)  # by first batch
    assert sorted(b for s in shards for b in s.batch_indices()) == list(range(N_BATCHES))  # each once
    for name, stats in want.stats.items():  # sums over other shards: equal up to float addition order
        assert got.stats[name].norm_count == stats.norm_count
        assert got.stats[name].norm_sum == pytest.approx(stats.norm_sum, rel=1e-12)
    sizes = [m for m, _ in HISTORIES[history]] + [finish]
    changes = sum(a != b for a, b in zip(sizes, sizes[1:], strict=False))
    assert got.manifest.generation == changes  # a new attempt exactly when the world size changed
    # a finished store re-opened with yet another world size has nothing left to write
    with ShardWriter(out, SETTINGS, shard_rows=SHARD_ROWS, rank=0, world_size=4) as w:
        assert (
            not any(w.owns(i) for i in range(N_BATCHES + 5))
            or min(i for i in range(N_BATCHES + 5) if w.owns(i)) == N_BATCHES
        )


def test_same_world_size_resume_is_unchanged(tmp_path):
    """Two ranks stopped and resumed by two ranks write the files an uninterrupted 2-rank run writes."""

    def shards(out: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted((out / "shards").iterdir())}

    write_attempt(str(tmp_path / "a"), 2, [None, None])
    write_attempt(str(tmp_path / "b"), 2, [3, 6])
    write_attempt(str(tmp_path / "b"), 2, [None, None])
    assert shards(tmp_path / "a") == shards(tmp_path / "b")
    assert (tmp_path / "a" / "manifest.json").read_bytes() == (tmp_path / "b" / "manifest.json").read_bytes()


def test_deal_gives_every_batch_to_one_rank():
    rng = random.Random(0)
    for _ in range(200):
        world_size = rng.randint(1, 5)
        done = tuple(sorted(rng.sample(range(60), rng.randint(0, 40))))
        deal = Deal(1, world_size, done)
        for b in range(80):
            assert sum(deal.visits(b, r) for r in range(world_size)) == 1
        assert deal.visits(0, 0)
        owners = [deal.owner(b) for b in range(80) if b not in done]
        assert owners == [j % world_size for j in range(len(owners))]  # round robin over what is left
        assert all(deal.owner(b) is None for b in done)


def test_orphans_of_an_earlier_attempt_are_removed(tmp_path):
    out = tmp_path / "store"
    write_attempt(str(out), 2, [4, 4])
    shard = next((out / "shards").glob("shard-r001-*.safetensors"))
    orphan = out / "shards" / "shard-r001-000007.safetensors"  # uploaded, never committed, then killed
    orphan.write_bytes(shard.read_bytes())
    tmp = out / "shards" / "shard-r000-000005.safetensors.tmp"
    tmp.write_bytes(b"half a shard")
    write_attempt(str(out), 1, [None])
    assert not orphan.exists() and not tmp.exists()
    assert shard.exists()  # a committed shard of the old attempt stays, listed in the new manifest
    assert open_store(out, verify=True).manifest.done_batches() == set(range(N_BATCHES))


def test_a_batch_in_two_shards_is_refused(tmp_path):
    out = tmp_path / "store"
    write_attempt(str(out), 2, [4, 4])
    path = out / "manifest.rank1.json"
    raw = json.loads(path.read_text())
    raw["shards"][0]["batches"] = [[0, 0, 1]]  # rank 0's first batch, claimed by rank 1 too
    path.write_text(json.dumps(raw))
    with pytest.raises(StoreError, match="batch 0 is in both"):
        ShardWriter(out, SETTINGS, shard_rows=SHARD_ROWS)


def to_version_1(out: Path, world_size: int) -> None:
    """Rewrite a store as hookscope wrote it before elastic resume (format version 1): shards say
    `batches START-END of rank R` (no step), the manifest lists batch_start / batch_end."""
    for name in ["manifest.json", *[f"manifest.rank{r}.json" for r in range(world_size) if world_size > 1]]:
        raw = json.loads((out / name).read_text())
        for s in raw["shards"]:
            ((first, last, step),) = s.pop("batches")
            assert step in (1, world_size)
            path = out / s["file"]
            identity = f"batches {first}-{last} of rank {s['rank']}, settings {raw['settings_hash']}"
            save_file(load_file(path), path, metadata={"hookscope.shard": identity})
            with open(path, "rb") as f:
                s.pop("xxh3_128")  # version 1 knew SHA-256 only
                s["bytes"], s["sha256"] = sha256_of(f)
            s.update(batch_start=first, batch_end=last)
            del s["stats"], s["generation"]
        del raw["generation"]
        raw["version"] = 1
        raw["bytes"] = sum(s["bytes"] for s in raw["shards"])
        (out / name).write_text(json.dumps(raw, indent=1))


@pytest.mark.parametrize("world_size", [1, 2])
def test_version_1_store_opens_and_refuses_a_resume(tmp_path, reference, world_size):
    out = tmp_path / "old"
    write_attempt(str(out), world_size, [None] * world_size)
    to_version_1(out, world_size)
    old = open_store(out, verify=True)
    assert old.manifest.version == 1 and same_rows(old, open_store(reference))
    assert old.manifest.done_batches() == set(range(N_BATCHES))
    with pytest.raises(StoreError, match="older hookscope .*store format 1.*new --out"):
        ShardWriter(out, SETTINGS, shard_rows=SHARD_ROWS, world_size=world_size)
