"""Reads for transcoders, crosscoders and cross-layer transcoders: several points in one aligned,
shuffled batch, and each glob's points stacked across layers (`stack=True`).

The reference is what the test wrote: every layer's rows are random values kept here, and each
row's `token_ids` is its global index, so a batch row is checked against the written rows of that
index, layer by layer (a stack in the wrong layer order, a layer from another row or a column
gathered into the wrong slice fails)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hookscope.errors import StoreError
from hookscope.store import ShardWriter, open_store
from hookscope.store.strided import Runs

LAYERS = 12  # past 10: block 10 must come after block 9, not after block 1
D = 6


@pytest.fixture(scope="module")
def clt_store(tmp_path_factory):
    """240 rows in shards of 32 rows (batches of 8); blocks.L.mlp.in / mlp.out / resid_post for 12
    layers, bfloat16; shard identities of different lengths (batches 0-3 vs 12-15). (On Linux the
    shards still lie in one strided run; windows of several parts are read below, shard by shard.)"""
    out = tmp_path_factory.mktemp("clt") / "store"
    g = torch.Generator().manual_seed(0)
    names = [
        f"blocks.{layer}.{kind}" for layer in range(LAYERS) for kind in ("mlp.in", "mlp.out", "resid_post")
    ]
    written = {n: (torch.randn(240, D, generator=g) * 4).to(torch.bfloat16) for n in names}
    with ShardWriter(out, {"test": "clt"}, shard_rows=32) as w:
        for b in range(30):
            rows = slice(b * 8, b * 8 + 8)
            w.write(
                b, {n: v[rows] for n, v in written.items()}, {"token_ids": torch.arange(b * 8, b * 8 + 8)}
            )
    return open_store(out), written


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def check_stack(stack: torch.Tensor, ids: torch.Tensor, written: dict, kind: str) -> None:
    assert stack.shape == (len(ids), LAYERS, D) and stack.dtype == torch.bfloat16
    for layer in range(LAYERS):
        assert torch.equal(bits(stack[:, layer]), bits(written[f"blocks.{layer}.{kind}"][ids])), (kind, layer)


@pytest.mark.parametrize(
    "kw",
    [
        {"batch_size": 24, "buffer_rows": 64},  # batches straddle windows (joined)
        {"batch_size": 24, "buffer_rows": 64, "shuffle": False},
        {"batch_size": 50, "buffer_rows": 1000, "rank": 1, "world_size": 2},
    ],
)
def test_a_crosscoder_stack_is_every_layer_of_each_row_in_block_order(clt_store, kw):
    store, written = clt_store
    ds = store.dataset(["blocks.*.resid_post", "token_ids"], stack=True, seed=5, **kw)
    assert ds.stacked == {"blocks.*.resid_post": [f"blocks.{i}.resid_post" for i in range(LAYERS)]}
    seen = []
    for batch in ds:
        ids = batch["token_ids"]
        assert ids.shape == (len(ids),)  # a plain name stays a plain column beside the stack
        check_stack(batch["blocks.*.resid_post"], ids, written, "resid_post")
        seen += ids.tolist()
    assert len(seen) == len(set(seen)) == ds.rows_per_epoch


def test_a_lone_glob_gives_the_bare_stack(clt_store):
    store, written = clt_store
    ds = store.dataset("blocks.*.resid_post", stack=True, batch_size=40, seed=1, buffer_rows=100)
    order = store.dataset("token_ids", batch_size=40, seed=1, buffer_rows=100)
    for batch, ids in zip(ds, order, strict=True):  # the same seed: the same rows in the same order
        assert isinstance(batch, torch.Tensor)
        check_stack(batch, ids, written, "resid_post")
        assert torch.equal(batch.contiguous(), batch)  # the layer-major view copies to the same values


def test_a_cross_layer_transcoders_two_stacks_share_one_shuffle_order(clt_store):
    store, written = clt_store
    ds = store.dataset(
        ["blocks.*.mlp.in", "blocks.*.mlp.out", "token_ids"],
        stack=True,
        batch_size=32,
        seed=7,
        buffer_rows=96,
    )
    seen = []
    for batch in ds:
        assert set(batch) == {"blocks.*.mlp.in", "blocks.*.mlp.out", "token_ids"}
        check_stack(batch["blocks.*.mlp.in"], batch["token_ids"], written, "mlp.in")
        check_stack(batch["blocks.*.mlp.out"], batch["token_ids"], written, "mlp.out")
        seen += batch["token_ids"].tolist()
    assert sorted(seen) == list(range(240))
    assert seen != sorted(seen)  # shuffled


def test_stacked_rows_one_by_one(clt_store):
    store, written = clt_store
    rows = list(store.dataset(["blocks.*.mlp.out", "token_ids"], stack=True, seed=2, buffer_rows=50))
    assert len(rows) == 240
    for row in rows[:40]:
        i = int(row["token_ids"])
        assert row["blocks.*.mlp.out"].shape == (LAYERS, D)
        for layer in range(LAYERS):
            assert torch.equal(
                bits(row["blocks.*.mlp.out"][layer]), bits(written[f"blocks.{layer}.mlp.out"][i])
            )


def test_a_transcoder_pair_is_aligned(clt_store):
    """`[mlp.in, mlp.out]` of one layer: two columns, one row order, each row's own values."""
    store, written = clt_store
    ds = store.dataset(
        ["blocks.6.mlp.in", "blocks.6.mlp.out", "token_ids"], batch_size=33, seed=3, buffer_rows=64
    )
    n = 0
    for batch in ds:
        ids = batch["token_ids"]
        for kind in ("mlp.in", "mlp.out"):
            assert torch.equal(bits(batch[f"blocks.6.{kind}"]), bits(written[f"blocks.6.{kind}"][ids]))
        n += len(ids)
    assert n == 240


def test_a_glob_without_stack_gives_each_column(clt_store):
    store, _ = clt_store
    batch = next(iter(store.dataset("blocks.1*.mlp.in", batch_size=4)))
    assert list(batch) == ["blocks.1.mlp.in", "blocks.10.mlp.in", "blocks.11.mlp.in"]


@pytest.mark.parametrize(
    "point, stack, message",
    [
        ("blocks.*.attn.out", True, "matches no column"),
        ("*", True, "different shapes or dtypes"),  # the points and token_ids
        (["blocks.*.mlp.in", "blocks.1*.mlp.out"], True, "must match the same blocks"),
        (["blocks.*.mlp.in", "blocks.3.mlp.in"], True, "name some columns twice"),
        ("blocks.6.mlp.inn", False, "no column 'blocks.6.mlp.inn'"),
    ],
)
def test_what_cannot_be_read_is_refused_clearly(clt_store, point, stack, message):
    store, _ = clt_store
    with pytest.raises(StoreError, match=message):
        store.dataset(point, stack=stack)


def test_a_stack_of_different_dtypes_is_refused(tmp_path):
    with ShardWriter(tmp_path / "s", {"t": 1}, shard_rows=4) as w:
        w.write(
            0,
            {"blocks.0.x": torch.zeros(4, 3, dtype=torch.bfloat16), "blocks.1.x": torch.zeros(4, 3)},
            {"token_ids": torch.arange(4)},
        )
    with pytest.raises(StoreError, match=r"blocks.0.x \[3\] bfloat16, blocks.1.x \[3\] float32"):
        open_store(tmp_path / "s").dataset("blocks.*.x", stack=True)


def test_stacked_batches_from_dataloader_workers(clt_store):
    """Workers gather into shared memory; the stack's layout survives the trip."""
    store, written = clt_store
    ds = store.dataset(
        ["blocks.*.resid_post", "token_ids"], stack=True, batch_size=48, seed=4, buffer_rows=96
    )
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    seen = []
    for batch in loader:
        check_stack(batch["blocks.*.resid_post"], batch["token_ids"], written, "resid_post")
        seen += batch["token_ids"].tolist()
    assert sorted(seen) == list(range(240))


def one_part_store(path, names_widths: dict[str, int], rows: int = 200):
    """Shards of 32 rows whose identities all have one length (batches from 1000), so that every
    shard lies on one stride and a window is one part: the path where a stack of columns that are
    rows of one mapping is gathered in one `index_select` (store/mapper.py, window.py). The last
    shard is short (8 rows), so its columns lie at other distances from each other."""
    g = torch.Generator().manual_seed(1)
    written = {n: (torch.randn(rows, w, generator=g) * 4).to(torch.bfloat16) for n, w in names_widths.items()}
    with ShardWriter(path, {"test": "one part"}, shard_rows=32) as w:
        for b in range(rows // 8):
            at = slice(b * 8, b * 8 + 8)
            w.write(
                1000 + b,
                {n: v[at] for n, v in written.items()},
                {"token_ids": torch.arange(b * 8, b * 8 + 8)},
            )
    return open_store(path), written


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_stack_of_one_mapping_is_every_layer_of_each_row(tmp_path, shuffle):
    """Columns side by side in each file, read through one mapping of it: a wrong row offset for a
    borrowed column, or the stack's indices joined in the wrong order, gives another row's or another
    layer's values."""
    names = {f"blocks.{layer}.{kind}": D for layer in range(LAYERS) for kind in ("mlp.in", "mlp.out")}
    store, written = one_part_store(tmp_path / "s", names)
    ds = store.dataset(
        ["blocks.*.mlp.in", "blocks.*.mlp.out", "token_ids"],
        stack=True,
        batch_size=48,
        seed=3,
        buffer_rows=64,
        shuffle=shuffle,
    )
    seen = []
    for batch in ds:
        check_stack(batch["blocks.*.mlp.in"], batch["token_ids"], written, "mlp.in")
        check_stack(batch["blocks.*.mlp.out"], batch["token_ids"], written, "mlp.out")
        seen += batch["token_ids"].tolist()
    assert sorted(seen) == list(range(200))


def test_a_stack_across_columns_of_another_width(tmp_path):
    """`blocks.L.a` (6 wide) with `blocks.L.b` (5 wide) between them in each file: some `a` columns
    lie a whole number of rows after an earlier one (one mapping), others do not (their own); the
    stack is right either way, and `b` beside it too."""
    names = {
        f"blocks.{layer}.{kind}": width for layer in range(LAYERS) for kind, width in (("a", 6), ("b", 5))
    }
    store, written = one_part_store(tmp_path / "s", names)
    ds = store.dataset(
        ["blocks.*.a", "blocks.3.b", "token_ids"], stack=True, batch_size=40, seed=2, buffer_rows=64
    )
    seen = []
    for batch in ds:
        ids = batch["token_ids"]
        stack = batch["blocks.*.a"]
        assert stack.shape == (len(ids), LAYERS, 6)
        for layer in range(LAYERS):
            assert torch.equal(bits(stack[:, layer]), bits(written[f"blocks.{layer}.a"][ids])), layer
        assert torch.equal(bits(batch["blocks.3.b"]), bits(written["blocks.3.b"][ids]))
        seen += ids.tolist()
    assert sorted(seen) == list(range(200))


def irregular_store(path, shard_rows: int, first_batch: int = 0):
    """150 rows of 11 layers' mlp.in / mlp.out / resid_post (bfloat16, 6 wide), written in batches of 3,
    5, 8, 2 and 7 rows, so that shards (cut at the first batch that reaches `shard_rows`) hold uneven
    numbers of rows and their boundaries fall anywhere in a read batch or window."""
    g = torch.Generator().manual_seed(shard_rows)
    names = [f"blocks.{layer}.{kind}" for layer in range(11) for kind in ("mlp.in", "mlp.out", "resid_post")]
    written = {n: (torch.randn(150, D, generator=g) * 4).to(torch.bfloat16) for n in names}
    sizes, at, b = [3, 5, 8, 2, 7], 0, 0
    with ShardWriter(path, {"test": "irregular"}, shard_rows=shard_rows) as w:
        while at < 150:
            n = min(sizes[b % len(sizes)], 150 - at)
            w.write(
                first_batch + b,
                {k: v[at : at + n] for k, v in written.items()},
                {"token_ids": torch.arange(at, at + n)},
            )
            at, b = at + n, b + 1
    return open_store(path), written


@pytest.mark.parametrize("shard_rows, first_batch", [(1, 0), (9, 0), (20, 1000), (64, 0), (500, 0)])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("mapping", ["strided", "shard by shard"])
@pytest.mark.slow
def test_stacks_equal_the_written_points_across_shard_boundaries(
    tmp_path, monkeypatch, shard_rows, first_batch, shuffle, mapping
):
    """A crosscoder's stack and a CLT's two stacks, batch by batch, against the bytes written for each
    point, row by row through `token_ids`: shards of one write to the whole store in one shard, cut
    inside batches and windows; shard identities of different lengths or of one (`first_batch=1000`);
    shuffled and in order (then the rows come in written order, 0..149); the shards mapped side by
    side (one part: a stack in one gather) or one by one (each shard a part, as off Linux or at a
    URL: each column gathered into its slice, part by part). A stack in another layer order (block 10
    after block 1), a column read at another row, or a batch that mixes two rows' layers fails."""
    if mapping == "shard by shard":
        monkeypatch.setattr(Runs, "supported", staticmethod(lambda: False))
    store, written = irregular_store(tmp_path / "s", shard_rows, first_batch)
    for point in (["blocks.*.resid_post", "token_ids"], ["blocks.*.mlp.in", "blocks.*.mlp.out", "token_ids"]):
        ds = store.dataset(point, stack=True, batch_size=16, buffer_rows=40, seed=11, shuffle=shuffle)
        seen = []
        for batch in ds:
            ids = batch["token_ids"]
            for key in point[:-1]:
                stack, kind = batch[key], key.split("*.")[1]
                assert stack.shape == (len(ids), 11, D)
                for layer in range(11):
                    assert torch.equal(bits(stack[:, layer]), bits(written[f"blocks.{layer}.{kind}"][ids])), (
                        key,
                        layer,
                    )
            seen += ids.tolist()
        assert sorted(seen) == list(range(150))
        if not shuffle:
            assert seen == list(range(150))


@pytest.mark.parametrize("kept", ["blocks.*.mlp.in", "blocks.*.mlp.out"])
def test_a_kept_stack_is_never_overwritten(tmp_path, kept):
    """A CLT's two stacks share one buffer (window.py): a consumer that keeps only one of them, batch
    after batch over two epochs, still finds every kept stack equal to the written rows (the batch
    memory a later batch reuses must be memory no kept stack lies in)."""
    store, written = one_part_store(
        tmp_path / "s",
        {f"blocks.{layer}.{kind}": D for layer in range(LAYERS) for kind in ("mlp.in", "mlp.out")},
    )
    ds = store.dataset(
        ["blocks.*.mlp.in", "blocks.*.mlp.out", "token_ids"],
        stack=True,
        batch_size=24,
        seed=9,
        buffer_rows=64,
    )
    held = [(batch[kept], batch["token_ids"]) for _ in range(2) for batch in ds]
    assert len(held) == 2 * 9
    for stack, ids in held:
        check_stack(stack, ids, written, kept.split("*.")[1])


def test_cross_layer_transcoder_stacks_from_dataloader_workers(clt_store):
    """Two stacks in one buffer of shared memory survive the trip from a worker, each its own layers."""
    store, written = clt_store
    ds = store.dataset(
        ["blocks.*.mlp.in", "blocks.*.mlp.out", "token_ids"],
        stack=True,
        batch_size=48,
        seed=6,
        buffer_rows=96,
    )
    seen = []
    for batch in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2):
        check_stack(batch["blocks.*.mlp.in"], batch["token_ids"], written, "mlp.in")
        check_stack(batch["blocks.*.mlp.out"], batch["token_ids"], written, "mlp.out")
        seen += batch["token_ids"].tolist()
    assert sorted(seen) == list(range(240))


@pytest.mark.parametrize("drop_last", [True, False])
def test_batches_straddling_windows_are_gathered_into_batch_sized_memory(clt_store, monkeypatch, drop_last):
    """A split keeps an uneven number of each window's rows, so batches straddle windows: each
    window's rows go straight into their slice of one batch-sized buffer (no part buffers of odd
    sizes, no second copy). Every stack equals the written rows of its `token_ids`, every batch is
    its slice of the row-by-row stream (as a set), and over three epochs the batch memory comes from
    at most the pool's four buffers per shape, each a whole batch (or the epoch's short last one)."""
    from hookscope.store import recycler

    store, written = clt_store
    point = ["blocks.*.mlp.in", "blocks.*.mlp.out", "token_ids"]
    kw = {"stack": True, "seed": 8, "buffer_rows": 64, "split": "train", "val_fraction": 0.2}
    stream = [int(row["token_ids"]) for e in range(3) for row in store.dataset(point, epoch=e, **kw)]
    per_epoch = len(stream) // 3
    assert 0 < per_epoch % 24  # windows and the epoch end inside batches
    allocated = []
    new_array = recycler.new_array
    monkeypatch.setattr(
        recycler, "new_array", lambda shape, dtype: allocated.append(shape) or new_array(shape, dtype)
    )
    ds = store.dataset(point, batch_size=24, drop_last=drop_last, **kw)
    got = []
    for _ in range(3):
        for batch in ds:
            check_stack(batch["blocks.*.mlp.in"], batch["token_ids"], written, "mlp.in")
            check_stack(batch["blocks.*.mlp.out"], batch["token_ids"], written, "mlp.out")
            got.append(sorted(batch["token_ids"].tolist()))
    sizes = [24] * (per_epoch // 24) + ([] if drop_last else [per_epoch % 24])
    want = [
        sorted(stream[e * per_epoch :][at : at + n])
        for e in range(3)
        for at, n in zip(np.cumsum([0, *sizes[:-1]]).tolist(), sizes, strict=True)
    ]
    assert got == want
    short = per_epoch % 24
    shapes = {(24, 24, D), (24,)} | (set() if drop_last else {(24, short, D), (short,)})
    assert set(allocated) == shapes
    assert all(allocated.count(s) <= 4 for s in shapes)


def test_straddling_batches_from_dataloader_workers(clt_store):
    """With workers, a batch that straddles windows is filled in its worker's shared memory from both
    windows; the loader's batches are the single-process stream's, each row its own layers."""
    store, written = clt_store
    point = ["blocks.*.mlp.in", "blocks.*.mlp.out", "token_ids"]
    kw = {
        "stack": True,
        "seed": 3,
        "buffer_rows": 64,
        "split": "train",
        "val_fraction": 0.3,
        "batch_size": 20,
    }
    alone = [sorted(b["token_ids"].tolist()) for b in store.dataset(point, **kw)]
    got = []
    for batch in torch.utils.data.DataLoader(store.dataset(point, **kw), batch_size=None, num_workers=2):
        check_stack(batch["blocks.*.mlp.in"], batch["token_ids"], written, "mlp.in")
        check_stack(batch["blocks.*.mlp.out"], batch["token_ids"], written, "mlp.out")
        got.append(sorted(batch["token_ids"].tolist()))
    assert got == alone and len(alone) > 3
