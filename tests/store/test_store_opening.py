"""The store read once per run (store/opening.py): the extraction loop reads a `StoreView` before its
first batch and the writer opened later refuses if another run wrote to the store since; the
other ranks of the same run stamping and extending their own manifests meanwhile is no refusal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hookscope.errors import StoreError
from hookscope.store import ShardWriter, open_store
from hookscope.store.opening import StoreView

SETTINGS = {"k": 1}


def batch(i: int):
    return {"p": torch.full((4, 3), float(i))}, {"token_ids": torch.arange(4) + 4 * i}


@pytest.mark.parametrize("fresh", [True, False])
def test_a_store_written_by_another_run_since_the_read_is_refused(tmp_path: Path, fresh: bool):
    out = tmp_path / "s"
    if not fresh:
        with ShardWriter(out, SETTINGS, shard_rows=4) as w:
            w.write(0, *batch(0))
    view = StoreView.read(out, SETTINGS, 1)
    with ShardWriter(out, SETTINGS, shard_rows=4) as other:  # another run, between the read and the open
        other.write(1, *batch(1))
    with pytest.raises(StoreError, match="changed while this run started"):
        ShardWriter(out, SETTINGS, shard_rows=4, opened=view)
    assert len(open_store(out, verify=True)) == 4 * (1 if fresh else 2)  # nothing of this run written


def test_an_unchanged_store_opens_from_the_view_with_its_plan(tmp_path: Path):
    out = tmp_path / "s"
    with ShardWriter(out, SETTINGS, shard_rows=4) as w:
        w.write(0, *batch(0))
    view = StoreView.read(out, SETTINGS, 1)
    with ShardWriter(out, SETTINGS, shard_rows=4, opened=view) as w:
        assert w.done_batches == frozenset({0})
        w.write(1, *batch(1))
    want = torch.cat([batch(i)[0]["p"] for i in (0, 1)])
    assert torch.equal(open_store(out, verify=True).tensor("p"), want)


def test_the_other_ranks_of_the_run_writing_meanwhile_is_no_change(tmp_path: Path):
    out = tmp_path / "s"
    view = StoreView.read(out, SETTINGS, 2, rank=0)
    with ShardWriter(out, SETTINGS, shard_rows=4, rank=1, world_size=2) as rank1:  # stamps, then commits
        rank1.write(1, *batch(1))
    with ShardWriter(out, SETTINGS, shard_rows=4, rank=0, world_size=2, opened=view) as rank0:
        rank0.write(0, *batch(0))
    assert (out / "manifest.rank0.json").exists() and (out / "manifest.rank1.json").exists()


def test_rank_0_alone_puts_the_store_card_and_its_write_is_no_change(tmp_path: Path):
    """Two ranks putting README.md at once rename one README.md.tmp and the second rename fails (a
    torchrun run lost a rank so): only rank 0 puts the card, and rank 1 opening while rank 0's
    README.md.tmp is on disk is no refusal."""
    out = tmp_path / "s"
    view = StoreView.read(out, SETTINGS, 2, rank=1)
    out.mkdir()
    (out / "README.md.tmp").write_text("rank 0 mid-way through putting the card")
    with ShardWriter(out, SETTINGS, shard_rows=4, rank=1, world_size=2, opened=view) as rank1:
        rank1.write(1, *batch(1))
    assert not (out / "README.md").exists()
    with ShardWriter(out, SETTINGS, shard_rows=4, rank=0, world_size=2) as rank0:
        rank0.write(0, *batch(0))
    assert (out / "README.md").read_text().startswith("---")
