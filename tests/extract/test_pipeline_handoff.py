"""The extraction pipeline's hand-offs, on the CPU (the CUDA copy-out's own test is in test_cuda.py):
the writer waits on a batch's handoff before it reads the batch, and hands each reused buffer back
only once its bytes are in a shard; the ring (extract/ring.py) reuses what was handed back and keeps
memory flat; the data stage's columns equal boolean-mask indexing."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hookscope.errors import StoreError
from hookscope.extract.copyout import Handoff
from hookscope.extract.ring import HostRing, buffer_bytes, nbytes_of, views
from hookscope.sources.columns import token_columns
from hookscope.store import ShardWriter, open_store
from hookscope.store.stats import PointStats, stats_tensors

SETTINGS = {"test": "pipeline handoff"}
ROWS, WIDTH = 37, 24


def rows_of(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randn(ROWS + i % 3, WIDTH, generator=g).to(torch.bfloat16)


class LateCopy:
    """An event whose copy lands only when the writer synchronizes on it, a while after `write`
    returned: a writer that reads before it waits stores the buffer's old bytes."""

    def __init__(self, target: torch.Tensor, value: torch.Tensor):
        self.target, self.value = target, value

    def synchronize(self) -> None:
        time.sleep(0.01)
        self.target.copy_(self.value)


class Watched(Handoff):
    """A handoff that records, when its buffer is handed back, whether the batch's bytes are in a
    shard file already (its `.tmp` in the writer's staging directory, or its final place)."""

    def __init__(self, *args, store, value: torch.Tensor, log: list, renames: threading.Lock, **kwargs):
        super().__init__(*args, **kwargs)
        self.store, self.value, self.log, self.renames = store, value, log, renames

    def release(self) -> None:
        if self.buffer is not None:
            with self.renames:  # no shard moves from its .tmp to its place while the files are read
                written = b"".join(f.read_bytes() for f in (self.store / "shards").rglob("*.safetensors*"))
            self.log.append(self.value.view(torch.uint8).numpy().tobytes() in written)
        super().release()


def test_the_writer_waits_on_each_handoff_and_hands_buffers_back_after_writing(tmp_path):
    out, ring, log, renames = tmp_path / "store", HostRing(keep=6, pinned=False), [], threading.Lock()
    with ShardWriter(out, SETTINGS, shard_rows=3 * ROWS, queue_size=2) as writer:
        commit = writer._put_and_commit  # runs on the commit thread, beside the next shard's write

        def commit_holding_the_files(*args, **kwargs):
            with renames:
                return commit(*args, **kwargs)

        writer._put_and_commit = commit_holding_the_files
        for i in range(12):
            value = rows_of(i)
            buffer = ring.take(nbytes_of([value]))
            (view,) = views(buffer, [value])
            view.fill_(float("nan"))  # what a buffer holds before its copy lands
            parts = stats_tensors(value)  # as the device would compute them
            handoff = Watched(
                [LateCopy(view, value)],
                {"x": parts},
                ring,
                buffer,
                store=out,
                value=value,
                log=log,
                renames=renames,
            )
            writer.write(i, {"x": view}, {"token_ids": torch.arange(len(value)) + 1000 * i}, handoff=handoff)
    store = open_store(out, verify=True)
    want = torch.cat([rows_of(i) for i in range(12)])
    assert torch.equal(store.tensor("x"), want)  # every batch read after its copy landed
    assert all(log) and len(log) == 12  # each buffer back only once its bytes were in a shard file
    # the statistics given by the handoffs, merged: those of the stored rows (float64 reference)
    rows = want.double()
    norms = rows.norm(dim=1)
    stats = store.manifest.stats["x"]
    assert (stats.nonfinite, stats.norm_count) == (0, len(rows))
    assert stats.norm_sum == pytest.approx(float(norms.sum()), rel=1e-6)
    assert ring.made <= 6 and ring.out == 0  # reused: the writer's bounds, not one buffer per batch


class Scribbled(Handoff):
    """A handoff whose buffer is overwritten the moment it is handed back (the next batch's copy
    lands in it), and which notes when that was."""

    def __init__(self, *args, view: torch.Tensor, released: list, **kwargs):
        super().__init__(*args, **kwargs)
        self.view, self.released = view, released

    def release(self) -> None:
        if self.buffer is not None:
            self.view.fill_(float("nan"))
            self.released.append(time.perf_counter())
        super().release()


def test_a_shards_buffers_go_back_once_written_without_waiting_for_the_shard_before_to_commit(tmp_path):
    # the first shard's commit (its fsync) is held; the second shard's buffers must come back as
    # soon as its bytes are in its file, so the forward's next batches reuse them meanwhile
    ring, released, held = HostRing(keep=8, pinned=False), [], threading.Event()
    with ShardWriter(tmp_path / "store", SETTINGS, shard_rows=2 * ROWS, queue_size=4) as writer:
        commit = writer._put_and_commit

        def slow_commit(*args, **kwargs):
            held.wait(10)
            return commit(*args, **kwargs)

        writer._put_and_commit = slow_commit
        for i in range(4):  # two shards of two batches
            value = rows_of(i)
            buffer = ring.take(nbytes_of([value]))
            (view,) = views(buffer, [value])
            view.copy_(value)
            handoff = Scribbled([], {}, ring, buffer, view=view, released=released)
            writer.write(i, {"x": view}, handoff=handoff)
        deadline = time.perf_counter() + 10
        while len(released) < 4 and time.perf_counter() < deadline:
            time.sleep(0.01)
        back_while_held = len(released)
        held.set()
    assert back_while_held == 4  # the first shard's commit had not ended when the second's came back
    store = open_store(tmp_path / "store", verify=True)  # none of the scribbles reached a shard
    assert torch.equal(store.tensor("x"), torch.cat([rows_of(i) for i in range(4)]))
    assert ring.out == 0


def test_a_failed_writer_still_hands_every_buffer_back(tmp_path, monkeypatch):
    import hookscope.store.writer as writer_module

    def broken(*args, **kwargs):
        raise OSError("disk on fire")

    monkeypatch.setattr(writer_module, "save_columns", broken)
    ring = HostRing(keep=4, pinned=False)
    writer = ShardWriter(tmp_path / "store", SETTINGS, shard_rows=2 * ROWS)
    refused = 0  # a write that raises does not take its handoff: the caller still holds it
    for i in range(6):
        value = rows_of(i)
        buffer = ring.take(nbytes_of([value]))
        (view,) = views(buffer, [value])
        view.copy_(value)
        try:
            writer.write(i, {"x": view}, handoff=Handoff([], {}, ring, buffer))
        except StoreError:
            refused += 1
            ring.give_back(buffer)
        time.sleep(0.05)
    writer.close()  # the error was reported at a write already
    assert refused and ring.out == 0  # every batch the writer took was handed back, none twice
    assert len(ring.free) == ring.made


def test_a_batchs_statistics_are_measured_while_the_shard_before_is_still_being_copied(tmp_path, monkeypatch):
    # one batch a shard; the first shard's copy is held: the second batch's statistics (rows ready,
    # none given) must be measured meanwhile, not after that copy (a writer that measures on its own
    # thread, between shards, leaves the disk idle while it measures and itself idle while it copies)
    import hookscope.store.writer as writer_module

    held, measured, real_save, real_of = threading.Event(), [], writer_module.save_columns, PointStats.of

    def save_columns(columns, path, *args, **kwargs):
        if path.name.startswith("shard-r000-000000."):
            held.wait(60)
        return real_save(columns, path, *args, **kwargs)

    def measure(cls, rows, work=None):
        measured.append(rows)
        return real_of(rows, work)

    monkeypatch.setattr(writer_module, "save_columns", save_columns)
    monkeypatch.setattr(PointStats, "of", classmethod(measure))
    with ShardWriter(tmp_path / "store", SETTINGS, shard_rows=ROWS) as writer:
        for i in range(2):
            writer.write(i, {"x": rows_of(i)}, {"token_ids": torch.arange(len(rows_of(i)))})
        deadline = time.perf_counter() + 30
        while len(measured) < 2 and time.perf_counter() < deadline:
            time.sleep(0.01)
        during = [torch.equal(m, rows_of(i)) for i, m in enumerate(measured)]
        held.set()
    assert during == [True, True]  # both batches measured while the first shard was held
    store = open_store(tmp_path / "store", verify=True)
    rows = torch.cat([rows_of(0), rows_of(1)]).double()
    stats = store.manifest.stats["x"]
    assert stats.norm_count == len(rows)
    assert stats.norm_sum == pytest.approx(float(rows.norm(dim=1).sum()), rel=1e-6)


def test_the_ring_reuses_what_is_handed_back_and_never_hands_out_one_twice():
    ring = HostRing(keep=3, pinned=False)
    a, b = ring.take(1000), ring.take(1000)
    assert a.data_ptr() != b.data_ptr() and ring.made == 2
    ring.give_back(a)
    c = ring.take(900)
    assert c.data_ptr() == a.data_ptr() and ring.made == 2  # the free one, not a new one
    bigger = ring.take(a.numel() + 1)  # none free fits: a new one
    assert bigger.numel() > a.numel() and ring.made == 3
    for t in (b, c, bigger):
        ring.give_back(t)
    assert len(ring.free) == 3
    small = ring.take(10)
    ring.give_back(ring.take(10 * 2**20))  # a fourth: the smallest free one is dropped, 3 kept
    assert len(ring.free) + ring.out == 3
    ring.give_back(small)
    assert not handed_out_twice(ring, rounds=200) and ring.out == 0 and len(ring.free) <= 3


def handed_out_twice(ring: HostRing, rounds: int, hold: float = 0.0) -> list[int]:
    """Four threads taking and giving back buffers: the addresses ever held by two at once."""
    held, lock, twice = set(), threading.Lock(), []

    def worker():
        for _ in range(rounds):
            t = ring.take(100)
            with lock:
                if t.data_ptr() in held:
                    twice.append(t.data_ptr())
                held.add(t.data_ptr())
            time.sleep(hold)
            with lock:
                held.discard(t.data_ptr())
            ring.give_back(t)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return twice


def test_a_page_locked_buffer_is_asked_for_at_the_power_of_two_the_pinned_allocator_gives():
    # PyTorch's pinned allocator rounds every request up to a power of two: a 32,768 x 2048 bf16
    # batch (128 MiB) asked for with slack would pin 256 MiB; 16 such points, 4 GiB instead of 2
    point = 32_768 * 2048 * 2
    for nbytes in (point - 4096, point, 16 * point, 1000, 1):
        got = buffer_bytes(nbytes, pinned=True)
        assert got & (got - 1) == 0 and got >= nbytes and (got < 2 * nbytes or got == 64)
    assert buffer_bytes(point, pinned=True) == 2**27 and buffer_bytes(16 * point, pinned=True) == 2**31
    assert buffer_bytes(point + 1, pinned=True) == 2**28
    # ordinary memory is not rounded by its allocator: slack for batches that vary, whole MiB
    assert buffer_bytes(point, pinned=False) == point + point // 8


class Allocations:
    """An allocator that records the thread each buffer was made on, and takes a while."""

    def __init__(self, seconds: float = 0.02):
        self.threads: list[int] = []
        self.seconds = seconds

    def __call__(self, size: int, pinned: bool) -> torch.Tensor:
        time.sleep(self.seconds)
        self.threads.append(threading.get_ident())
        return torch.empty(size, dtype=torch.uint8)


def test_a_spare_buffer_is_made_ahead_on_another_thread_and_the_next_batch_takes_it():
    made = Allocations()
    ring = HostRing(keep=4, pinned=False, spare=True, allocate=made)
    first = ring.take(1000)
    assert made.threads == [threading.get_ident()]  # none free yet: made where it was asked
    second = ring.take(1000)  # the first still out: the spare, made meanwhile
    assert second.data_ptr() != first.data_ptr() and second.numel() >= 1000
    assert made.threads[1] != threading.get_ident() and ring.made_ahead >= 1
    held = [first, second] + [ring.take(1000) for _ in range(3)]  # past `keep`: made here, no spare kept
    assert len({b.data_ptr() for b in held}) == 5
    for b in held:
        ring.give_back(b)
    time.sleep(0.1)  # any spare in the making has landed (or been dropped)
    assert ring.out == 0 and len(ring.free) <= 4  # never more than `keep` held
    before = ring.made
    for _ in range(20):  # steady state: every buffer reused, none made, no spare started
        a, b = ring.take(1000), ring.take(900)
        ring.give_back(a)
        ring.give_back(b)
    assert ring.made == before and ring.out == 0


def test_a_closed_ring_leaves_no_spare_in_the_making():
    # a run's end: no thread of the ring may still be inside the allocator (a process exiting
    # with one there tears CUDA down under it)
    made = Allocations(0.2)
    ring = HostRing(keep=4, pinned=False, spare=True, allocate=made)
    ring.take(1000)
    ring.close()
    assert len(made.threads) == 2  # the spare was waited for, not left running
    ring.take(1000), ring.take(1000)  # the spare, then one made here
    time.sleep(0.3)
    assert len(made.threads) == 3 and made.threads[-1] == threading.get_ident()  # no spare after close


def test_a_ring_with_a_spare_never_hands_out_one_buffer_twice():
    ring = HostRing(keep=3, pinned=False, spare=True, allocate=Allocations(0.001))
    twice = handed_out_twice(ring, rounds=100, hold=0.0005)
    time.sleep(0.05)  # a spare in the making has landed
    assert not twice and ring.out == 0 and len(ring.free) <= 3


def test_views_lay_tensors_out_aligned_and_apart():
    tensors = [
        torch.zeros(3, 5, dtype=torch.bfloat16),
        torch.zeros(7, dtype=torch.float32),
        torch.zeros(0, 4, dtype=torch.float64),
        torch.zeros(2, 2, dtype=torch.int64),
    ]
    buffer = torch.zeros(nbytes_of(tensors), dtype=torch.uint8)
    placed = views(buffer, tensors)
    for i, (view, t) in enumerate(zip(placed, tensors, strict=True)):
        assert view.shape == t.shape and view.dtype == t.dtype and view.data_ptr() % 64 == 0
        view.fill_(i + 1)
    for i, view in enumerate(placed):  # none overlaps another
        assert bool((view == i + 1).all())


def test_token_columns_equal_boolean_mask_indexing():
    g = torch.Generator().manual_seed(4)
    batch = {
        "input_ids": torch.randint(0, 1000, (5, 13), generator=g),
        "doc_ids": torch.randint(0, 50, (5, 13), generator=g),
        "doc_positions": torch.randint(0, 13, (5, 13), generator=g),
        "seq_ids": torch.arange(5) + 70,
    }
    for keep in (
        torch.rand(5, 13, generator=g) > 0.3,
        torch.zeros(5, 13, dtype=torch.bool),
        torch.ones(5, 13, dtype=torch.bool),
    ):
        got = token_columns(batch, keep)
        assert torch.equal(got["token_ids"], batch["input_ids"][keep])
        assert torch.equal(got["doc_ids"], batch["doc_ids"][keep])
        assert torch.equal(got["positions"], batch["doc_positions"][keep])
        assert torch.equal(got["seq_ids"], batch["seq_ids"].unsqueeze(1).expand(5, 13)[keep])
        assert all(v.dtype == torch.int64 for v in got.values())


def test_stats_tensors_read_back_as_point_stats_of_the_rows():
    rows = rows_of(5).float()
    rows[3, 2] = float("nan")
    got, want = PointStats.of_tensors(*stats_tensors(rows)), PointStats.of(rows)
    assert (got.nonfinite, got.norm_count) == (want.nonfinite, want.norm_count) == (1, len(rows) - 1)
    assert got.norm_sum == pytest.approx(want.norm_sum, rel=1e-6)
    torch.testing.assert_close(got.mean, want.mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.m2, want.m2, rtol=1e-5, atol=1e-5)
