"""The store's dataset as trainers use it: endless iteration (`repeat=True`) with an exact cursor,
and the background prefetch of the next window (same rows, same order, read ahead, no leaked thread).

The reference for every order is the plain one-epoch dataset (tests/store/test_store.py checks that one
against the rows written); column "x" of the store holds each row's own index.
"""

from __future__ import annotations

import json
import threading
import time
from itertools import islice

import numpy as np
import pytest
import test_store
import torch

from hookscope.errors import StoreError
from hookscope.store import ShardWriter, open_store

id_store = test_store.id_store  # the fixture: 200 rows in 8 shards of 25, "x" holds each row's index
ids_of = test_store.ids_of


def batch_sets(batches) -> list[list[int]]:
    """Each batch's row ids, sorted: inside a batch rows come grouped by shard, so a batch is
    compared with its slice of the row-by-row stream as a set."""
    return [sorted(ids_of([b])) for b in batches]


def slices(rows: list[int], sizes: list[int]) -> list[list[int]]:
    out, at = [], 0
    for n in sizes:
        out.append(sorted(rows[at : at + n]))
        at += n
    return out


def epochs(store, first: int, n: int, **kw) -> list[int]:
    """Rows of epochs first..first+n-1, each from its own one-epoch dataset."""
    return [i for e in range(first, first + n) for i in ids_of(store.dataset("x", epoch=e, **kw))]


def test_repeat_runs_epoch_after_epoch_with_an_exact_cursor(id_store):
    kw = {"seed": 3, "buffer_rows": 60}
    ds = id_store.dataset("x", repeat=True, **kw)
    assert len(ds) == 200  # len counts one epoch
    rows = ids_of(islice(iter(ds), 530))
    assert rows == epochs(id_store, 0, 3, **kw)[:530]
    assert ds.state_dict()["epoch"] == 2 and ds.state_dict()["position"] == 130
    # the cursor resumes a fresh endless reader exactly where this one stopped
    fresh = id_store.dataset("x", repeat=True, **kw)
    fresh.load_state_dict(json.loads(json.dumps(ds.state_dict())))
    assert ids_of(islice(iter(fresh), 270)) == epochs(id_store, 2, 3, **kw)[130:400]
    assert fresh.state_dict()["epoch"] == 3 and fresh.state_dict()["position"] == 200


@pytest.mark.parametrize("world_size", [1, 3])
def test_the_stream_is_its_documented_definition(id_store, world_size):
    """Written out from the definition (docs/store-format.md): the shards in a seeded order,
    grouped into windows of at least `buffer_rows` rows, each window's rows in a seeded
    permutation, position p to rank p % world_size. x holds each row's global index."""
    seed, epoch, buffer_rows = 4, 2, 60
    shard_order = np.random.default_rng([seed, epoch, 2]).permutation(8)
    windows, current = [], []
    for i in shard_order.tolist():
        current.append(i)
        if 25 * len(current) >= buffer_rows:
            windows, current = [*windows, current], []
    windows += [current] if current else []
    stream = []
    for w, shards in enumerate(windows):
        rows = np.concatenate([np.arange(25 * i, 25 * i + 25) for i in shards])
        stream += rows[np.random.default_rng([seed, epoch, w, 3]).permutation(len(rows))].tolist()
    for rank in range(world_size):
        ds = id_store.dataset(
            "x", seed=seed, epoch=epoch, buffer_rows=buffer_rows, rank=rank, world_size=world_size
        )
        assert ids_of(ds) == stream[rank::world_size]


@pytest.mark.parametrize("batch_size", [None, 16])
def test_a_plain_loop_over_epochs_gets_each_epoch_whole(id_store, batch_size):
    """Each iter() after the first finds its first window read ahead (while the epoch before ended);
    the epochs are those of fresh datasets, and a cursor moved in between is obeyed, not the window
    read ahead."""
    kw = {"seed": 5, "buffer_rows": 60, "batch_size": batch_size}
    ds = id_store.dataset("x", **kw)
    got = [ids_of(ds) for _ in range(3)]
    assert (
        ds._prefetcher.ahead is not None and ds._prefetcher.ahead.plan.epoch == 3
    )  # epoch 3's first window, read ahead
    assert got == [ids_of(id_store.dataset("x", epoch=e, **kw)) for e in range(3)]
    ds.load_state_dict({"epoch": 7, "position": 48})
    fresh = id_store.dataset("x", **kw)
    fresh.load_state_dict({"epoch": 7, "position": 48})
    assert ids_of(ds) == ids_of(fresh)


@pytest.mark.parametrize("drop_last", [False, True])
def test_repeat_in_batches_keeps_each_epochs_batches(id_store, drop_last: bool):
    kw = {"seed": 1, "buffer_rows": 50, "batch_size": 32, "drop_last": drop_last}
    batches = list(islice(iter(id_store.dataset("x", repeat=True, **kw)), 3 * (6 + (not drop_last))))
    one_epoch = [b.shape[0] for b in id_store.dataset("x", **kw)]
    assert [b.shape[0] for b in batches] == one_epoch * 3  # no batch mixes two epochs
    assert ids_of(batches) == [i for e in range(3) for i in ids_of(id_store.dataset("x", epoch=e, **kw))]


def test_repeat_a_resumed_cursor_at_the_end_of_an_epoch(id_store):
    kw = {"seed": 4, "buffer_rows": 40, "batch_size": 50, "repeat": True}
    ds = id_store.dataset("x", **kw)
    it = iter(ds)
    first = [next(it) for _ in range(4)]  # exactly one epoch
    assert ds.state_dict()["epoch"] == 0 and ds.state_dict()["position"] == 200
    fresh = id_store.dataset("x", **kw)
    fresh.load_state_dict(ds.state_dict())
    got = first + list(islice(iter(fresh), 4))
    assert batch_sets(got) == slices(epochs(id_store, 0, 2, seed=4, buffer_rows=40), [50] * 8)


def test_repeat_with_nothing_to_yield_is_refused(id_store):
    with pytest.raises(StoreError, match="loop forever"):
        next(iter(id_store.dataset("x", batch_size=500, drop_last=True, repeat=True)))
    # without repeat the same dataset is simply empty
    assert list(id_store.dataset("x", batch_size=500, drop_last=True)) == []


@pytest.mark.parametrize(
    "kw",
    [
        {"seed": 2, "buffer_rows": 60},
        {"seed": 2, "buffer_rows": 30, "batch_size": 32},
        {"seed": 2, "buffer_rows": 1, "batch_size": 7, "drop_last": True},
        {"seed": 5, "buffer_rows": 50, "batch_size": 16, "rank": 1, "world_size": 3, "split": "train"},
        {"shuffle": False, "batch_size": 64},
    ],
)
def test_prefetch_changes_nothing_but_timing(id_store, kw):
    with_prefetch = list(id_store.dataset("x", **kw))
    without = list(id_store.dataset("x", prefetch=False, **kw))
    assert [t.shape for t in with_prefetch] == [t.shape for t in without]
    assert all(torch.equal(a, b) for a, b in zip(with_prefetch, without, strict=True))
    # and batches straddling windows hold exactly the rows of the row-by-row stream
    rows_kw = {k: v for k, v in kw.items() if k not in ("batch_size", "drop_last")}
    flat = ids_of(id_store.dataset("x", **rows_kw))
    if "batch_size" in kw:
        assert batch_sets(with_prefetch) == slices(flat, [len(t) for t in with_prefetch])
    else:  # row by row: exactly the stream's order
        assert ids_of(with_prefetch) == flat


def record_shard_reads(store, monkeypatch) -> list[int]:
    """The shards a dataset reads in, in order: through `column_offsets` (mapped side by side) or
    `load_shard` (one by one)."""
    reads: list[int] = []
    for method in ("load_shard", "column_offsets"):
        real = getattr(type(store), method)

        def recording(self, i, names=None, real=real):
            reads.append(i)
            return real(self, i, names)

        monkeypatch.setattr(type(store), method, recording)
    return reads


def test_the_next_window_is_read_while_the_current_one_is_consumed(id_store, monkeypatch):
    ds = id_store.dataset("x", seed=0, buffer_rows=50, batch_size=10)  # windows of 2 shards
    windows = ds._planner.windows(0)
    requested = record_shard_reads(id_store, monkeypatch)
    it = iter(ds)
    next(it)  # one batch of the first window taken, the rest of it not yet consumed
    deadline = time.monotonic() + 10
    while len(requested) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert requested == windows[0] + windows[1]
    # without prefetch nothing beyond the first window is read yet
    requested.clear()
    it2 = iter(id_store.dataset("x", seed=0, buffer_rows=50, batch_size=10, prefetch=False))
    next(it2)
    time.sleep(0.1)
    assert requested == windows[0]
    del it, it2


def test_an_abandoned_iterator_leaves_no_reading_thread(id_store):
    def readers() -> int:
        return sum(t.name.startswith("hookscope-prefetch") for t in threading.enumerate())

    for _ in range(5):
        next(iter(id_store.dataset("x", seed=1, buffer_rows=25, batch_size=8, repeat=True)))
    it = iter(id_store.dataset("x", seed=1, buffer_rows=25, batch_size=8, repeat=True))
    next(it)
    assert readers() >= 1  # a live iterator is reading ahead
    del it
    deadline = time.monotonic() + 10  # an in-flight read finishes, then its thread ends
    while readers() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert readers() == 0


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.slow
def test_dataloader_workers_make_the_single_process_stream(id_store, workers: int):
    """`batch_size=None` in the DataLoader, the dataset's own batches: batch b is made by worker
    b % workers, so the loader's in-order output is exactly the batches one process makes."""
    kw = {"seed": 6, "buffer_rows": 50, "batch_size": 32}
    loader = torch.utils.data.DataLoader(id_store.dataset("x", **kw), batch_size=None, num_workers=workers)
    got, want = list(loader), list(id_store.dataset("x", **kw))
    assert [b.shape for b in got] == [b.shape for b in want] == [(32, 3)] * 6 + [(8, 3)]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # endless, across epochs, and with the cursor restored mid-epoch
    endless = id_store.dataset("x", repeat=True, **kw)
    endless.load_state_dict({"epoch": 1, "position": 96})
    loader = torch.utils.data.DataLoader(endless, batch_size=None, num_workers=workers)
    got = list(islice(iter(loader), 10))
    want = list(id_store.dataset("x", epoch=1, **kw))[3:] + list(id_store.dataset("x", epoch=2, **kw))[:6]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and len(got) == 10


def test_workers_forked_from_a_dataset_already_read_make_their_own_reader(id_store):
    """A dataset iterated in the main process holds a reading thread and the next epoch's first
    window read ahead; forked workers inherit the objects but not the thread, so each must start
    its own (else it waits forever for a read no thread will do)."""
    kw = {"seed": 6, "buffer_rows": 50, "batch_size": 32}
    ds = id_store.dataset("x", **kw)
    first = list(ds)  # epoch 0 here; epoch 1's first window is now being read ahead
    assert ds._prefetcher._pool is not None and ds._prefetcher.ahead is not None
    ctx = "fork" if "fork" in torch.multiprocessing.get_all_start_methods() else None
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=2, multiprocessing_context=ctx, timeout=60
    )
    got = list(loader)  # epoch 1, made by the workers
    want = list(id_store.dataset("x", epoch=1, **kw))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)) and len(got) == len(want)
    assert ids_of(first) == ids_of(id_store.dataset("x", epoch=0, **kw))


def test_dataloader_workers_share_rows_one_by_one(id_store):
    """Row by row with the DataLoader batching: every row of the epoch exactly once."""
    loader = torch.utils.data.DataLoader(
        id_store.dataset("x", seed=2, buffer_rows=60), batch_size=16, num_workers=2
    )
    assert sorted(ids_of(loader)) == list(range(200))


class _SharedProbe(torch.utils.data.IterableDataset):
    """Says, from inside the worker, whether each batch was made in shared memory."""

    def __init__(self, ds):
        super().__init__()
        self.ds = ds

    def __iter__(self):
        for batch in self.ds:
            yield torch.tensor(batch.is_shared())


def test_a_worker_makes_its_batches_in_shared_memory(id_store):
    """So the DataLoader sends a handle instead of first copying each batch into shared memory
    (batches straddling two windows included); in the main process they are ordinary tensors."""
    ds = id_store.dataset("x", seed=6, buffer_rows=50, batch_size=32)
    loader = torch.utils.data.DataLoader(_SharedProbe(ds), batch_size=None, num_workers=1)
    assert [bool(x) for x in loader] == [True] * 7
    assert not any(b.is_shared() for b in ds)


@pytest.fixture(scope="module")
def mixed_store(tmp_path_factory):
    """100 rows in shards of 16 (the last short): bfloat16 (n, 5), float16 (n, 2, 3), and
    token_ids holding each row's global index."""
    out = tmp_path_factory.mktemp("mixed") / "s"
    g = torch.Generator().manual_seed(0)
    with ShardWriter(out, {"mixed": True}, shard_rows=16) as w:
        for b in range(25):
            w.write(
                b,
                {
                    "a": torch.randn(4, 5, generator=g).to(torch.bfloat16),
                    "h": torch.randn(4, 2, 3, generator=g).half(),
                },
                {"token_ids": torch.arange(b * 4, b * 4 + 4)},
            )
    return open_store(out)


@pytest.mark.parametrize(
    "kw",
    [
        {"batch_size": 13, "buffer_rows": 40},
        {"batch_size": 13, "buffer_rows": 40, "shuffle": False},
        {"batch_size": 7, "buffer_rows": 1, "drop_last": True},  # a window per shard
        {"buffer_rows": 33},  # row by row
        {
            "batch_size": 32,
            "buffer_rows": 1000,
            "rank": 1,
            "world_size": 2,
            "split": "val",
            "val_fraction": 0.5,
        },
    ],
)
def test_every_row_is_the_stores_bytes(mixed_store, kw):
    """Each yielded row, any dtype or shape, is bit for bit the row the store holds (compared with
    `store.tensor`, the columns read whole in store order), matched through its token id."""
    whole = {k: mixed_store.tensor(k) for k in ("a", "h")}
    ds = mixed_store.dataset(["a", "h", "token_ids"], seed=3, **kw)
    items = list(ds)
    seen = []
    for item in items:
        ids = item["token_ids"].reshape(-1)
        for k in ("a", "h"):
            got = item[k].reshape(len(ids), *whole[k].shape[1:])
            assert got.dtype == whole[k].dtype
            assert torch.equal(got.view(torch.int16), whole[k][ids].view(torch.int16))
        seen += ids.tolist()
    assert len(seen) == len(set(seen))  # no row twice
    assert len(seen) == (len(ds) * kw["batch_size"] if kw.get("drop_last") else ds.rows_per_epoch)


def test_mappings_are_kept_across_epochs_only_when_they_fit(mixed_store, monkeypatch):
    """Shards are mapped once per iterator while the columns fit in half the RAM (later epochs
    touch no new mapping), once per window otherwise; the rows are the same either way."""
    from hookscope.store import mapper as mapper_module

    opened = record_shard_reads(mixed_store, monkeypatch)
    kw = {"seed": 1, "buffer_rows": 40, "batch_size": 10, "repeat": True}
    ds = mixed_store.dataset("a", **kw)
    kept = list(islice(iter(ds), 30))  # 3 epochs of 10 batches
    assert sorted(opened) == list(range(mixed_store.num_shards))
    next(iter(ds))  # a new iterator of the same dataset (the next epoch of a plain loop) too
    assert sorted(opened) == list(range(mixed_store.num_shards))
    opened.clear()
    monkeypatch.setattr(mapper_module, "ram_bytes", lambda: 0)
    dropped = list(islice(iter(mixed_store.dataset("a", **kw)), 30))
    # once per epoch (and the next epoch's first window, read ahead)
    assert all(3 <= opened.count(i) <= 4 for i in range(mixed_store.num_shards))
    assert all(torch.equal(a, b) for a, b in zip(kept, dropped, strict=True))


@pytest.mark.parametrize("position", [0, 45, 96, 130])
@pytest.mark.parametrize("workers", [0, 2])
def test_batches_are_their_slices_of_the_stream_from_any_cursor(id_store, position: int, workers: int):
    """Each batch holds exactly its slice of the row-by-row stream (rows sorted by shard inside it,
    worked out a window ahead), from a restored cursor on or off a batch boundary, across windows
    and epochs, with DataLoader workers too."""
    kw = {"seed": 9, "buffer_rows": 40, "batch_size": 16}
    stream = ids_of(id_store.dataset("x", epoch=2, **{k: v for k, v in kw.items() if k != "batch_size"}))
    stream += ids_of(id_store.dataset("x", epoch=3, **{k: v for k, v in kw.items() if k != "batch_size"}))
    ds = id_store.dataset("x", repeat=True, **kw)
    ds.load_state_dict({"epoch": 2, "position": position})
    loader = ds if workers == 0 else torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    rest = stream[position:200]  # the resumed epoch's rows, then the next epoch's from its start
    sizes = [16] * (len(rest) // 16) + ([len(rest) % 16] if len(rest) % 16 else [])
    want = slices(rest, sizes) + slices(stream[200:], [16] * 12 + [8])
    got = [sorted(ids_of([b])) for b in islice(iter(loader), len(want))]
    assert got == want


def test_batch_memory_is_reused_only_once_nothing_holds_it(id_store, monkeypatch):
    """A batch is gathered into memory an earlier batch let go of (faulting fresh memory in costs as
    much as the gather), never into one the consumer still holds: whole, as a view, or as its
    `.numpy()`. The reference is the row-by-row stream, read one row at a time."""
    kw = {"seed": 5, "buffer_rows": 60}
    rows = epochs(id_store, 0, 2, **kw)
    sizes = [16] * 12 + [8]  # 200 rows per epoch in batches of 16
    expected = slices(rows[:200], sizes) + slices(rows[200:], sizes)

    def two_epochs(keep):
        ds = id_store.dataset("x", batch_size=16, **kw)
        kept = [keep(b) for _ in range(2) for b in ds]
        return ds, kept

    # everything held, in three ways: nothing may be overwritten
    for keep in (lambda b: b, lambda b: b[:], lambda b: b.numpy()):
        _, kept = two_epochs(keep)
        assert [sorted(torch.as_tensor(k)[:, 0].long().tolist()) for k in kept] == expected
    # nothing held: after the first few, batches reuse memory (counted where numpy allocates it)
    from hookscope.store import recycler

    allocated = []
    new_array = recycler.new_array
    monkeypatch.setattr(
        recycler, "new_array", lambda shape, dtype: allocated.append(shape) or new_array(shape, dtype)
    )
    ds = id_store.dataset("x", batch_size=16, **kw)
    got = [sorted(b[:, 0].long().tolist()) for _ in range(2) for b in ds]
    assert got == expected
    assert 0 < allocated.count((16, 3)) <= 4  # 26 batches of 16 rows, at most the pool's 4 buffers
    # a held batch stays as it was while later ones are made
    it = iter(ds)
    first = next(it)
    snapshot = first.clone()
    for _ in range(12):
        next(it)
    assert torch.equal(first, snapshot)


def test_a_consumer_that_lets_go_of_each_batch_gets_the_same_memory_back(id_store):
    """`for b in ds: b = b.to(device)` lets go of the host batch before asking for the next: the
    next is gathered into that memory (one buffer stays in the cache; alternating two of them
    measured 9-19 % slower when a batch is near the cache's size), and holds the right rows."""
    kw = {"seed": 4, "buffer_rows": 60}
    expected = slices(epochs(id_store, 0, 1, **kw), [16] * 12 + [8])
    ds = id_store.dataset("x", batch_size=16, **kw)
    batches, got, addresses = iter(ds), [], set()
    while (b := next(batches, None)) is not None:
        got.append(sorted(b[:, 0].long().tolist()))
        if len(b) == 16:  # (the short last batch is memory of its own size)
            addresses.add(b.data_ptr())
        del b
    assert got == expected
    assert len(addresses) == 1


def test_several_columns_reuse_memory_and_keep_their_bytes(mixed_store, monkeypatch):
    """Three columns of three shapes and dtypes share the pool (four buffers a column): each batch
    is the store's bytes, and after the first few each column's batches reuse memory."""
    from hookscope.store import recycler

    allocated = []
    new_array = recycler.new_array
    monkeypatch.setattr(
        recycler, "new_array", lambda shape, dtype: allocated.append(shape) or new_array(shape, dtype)
    )
    whole = {k: mixed_store.tensor(k) for k in ("a", "h")}
    ds = mixed_store.dataset(["a", "h", "token_ids"], seed=2, batch_size=10, buffer_rows=40, drop_last=True)
    batches = 0
    for _ in range(3):
        for item in ds:
            ids = item["token_ids"]
            for k in ("a", "h"):
                assert torch.equal(item[k].view(torch.int16), whole[k][ids].view(torch.int16))
            batches += 1
    assert batches == 30
    for shape in ((10, 5), (10, 2, 3), (10,)):  # 30 batches of each column
        assert 0 < allocated.count(shape) <= 4, (shape, allocated.count(shape))


def test_store_dataset_passes_every_keyword_through_and_names_each(id_store):
    """`Store.dataset` is `ActivationDataset` without the store: each keyword reaches the dataset
    (the rows are the ones the same keywords give `ActivationDataset` directly, or its options as
    a `DatasetOptions`), its docstring names every keyword the dataset takes (each a field of
    `DatasetOptions`), and a misspelt keyword is refused, not ignored."""
    import dataclasses
    import re

    from hookscope.store import DatasetOptions
    from hookscope.store.dataset import ActivationDataset

    keywords = [f.name for f in dataclasses.fields(DatasetOptions)]
    documented = re.findall(r"`(\w+)`", id_store.dataset.__doc__)
    assert set(keywords) <= set(documented), set(keywords) - set(documented)
    kw = dict(
        seed=3,
        buffer_rows=16,
        split="val",
        val_fraction=0.25,
        rank=1,
        world_size=2,
        epoch=2,
        batch_size=4,
        drop_last=True,
        prefetch=False,
    )
    got = [b["x"][:, 0].long().tolist() for b in id_store.dataset(["x"], **kw)]
    want = [b["x"][:, 0].long().tolist() for b in ActivationDataset(id_store, ["x"], **kw)]
    assert got == want and got and all(len(b) == 4 for b in got)
    options = DatasetOptions(**kw)
    assert got == [b["x"][:, 0].long().tolist() for b in ActivationDataset(id_store, ["x"], options)]
    assert got != [b["x"][:, 0].long().tolist() for b in id_store.dataset(["x"], **{**kw, "seed": 4})]
    with pytest.raises(TypeError, match="buffer_row"):
        id_store.dataset("x", buffer_row=16)
