"""The extraction pipeline's stages (extract/stages.py): a run names the stage that bounds it. Each
test makes one stage deliberately slow (batches that sleep as they are packed, a model whose first
block sleeps, a shard file write that sleeps) and checks that the summary names that stage, with
the largest busy share; and the rows are those of a run without the delay."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import corpus_fixture

import hookscope.store.writer as writer_module
from hookscope.extract import ExtractConfig, InMemory, extract
from hookscope.extract.stages import Stages, ahead
from hookscope.sources import TextSource
from hookscope.store import open_store

corpus = corpus_fixture(60)
DELAY = 0.25  # seconds: far above what a stage of this tiny model costs


def config(tiny_dirs, corpus, out) -> ExtractConfig:
    return ExtractConfig(
        out=str(out),
        model=str(tiny_dirs["gpt2"]),
        points=["blocks.1.resid_post"],
        data=str(corpus),
        context=32,
        batch_size=4,
        dtype="float32",
        shard_rows=64,
        max_tokens=32 * 4 * 8,
        progress=False,
    )


def slow_data(monkeypatch) -> None:
    real = TextSource.batches

    def batches(self):
        for batch in real(self):
            time.sleep(DELAY)
            yield batch

    monkeypatch.setattr(TextSource, "batches", batches)


def slow_model(monkeypatch) -> None:
    real = InMemory.forward

    def forward(self, *args, **kwargs):  # the executor's step, on the main thread
        time.sleep(DELAY)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(InMemory, "forward", forward)


def slow_disk(monkeypatch) -> None:
    real = writer_module.save_columns

    def save_columns(*args, **kwargs):
        time.sleep(DELAY * 2)
        return real(*args, **kwargs)

    monkeypatch.setattr(writer_module, "save_columns", save_columns)


@pytest.fixture(scope="module")
def reference(tiny_dirs, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "store"
    extract(config(tiny_dirs, corpus, out))
    return open_store(out).tensor("blocks.1.resid_post")


@pytest.mark.parametrize(
    "slow, stage, says",
    [
        (slow_data, "data", "bound by tokenization: raise --workers"),
        (slow_model, "model", "bound by the model"),
        (slow_disk, "writer", "bound by the disk at"),
    ],
)
@pytest.mark.slow
def test_the_summary_names_the_slow_stage(
    slow, stage, says, tiny_dirs, corpus, reference, tmp_path, monkeypatch
):
    slow(monkeypatch)
    summary = extract(config(tiny_dirs, corpus, tmp_path / "store"))
    assert says in summary.bound and says in str(summary), str(summary)
    others = {k: v for k, v in summary.busy.items() if k not in (stage, "out")}
    assert summary.busy[stage] > 0.5 and all(summary.busy[stage] > v for v in others.values()), summary.busy
    assert torch.equal(open_store(tmp_path / "store", verify=True).tensor("blocks.1.resid_post"), reference)


def test_ahead_gives_every_item_in_order_and_raises_the_workers_error():
    stages = Stages()
    assert list(ahead(iter(range(50)), stages, depth=3)) == list(range(50))

    def failing():
        yield 1
        raise ValueError("the data broke")

    got = ahead(failing(), stages)
    assert next(got) == 1
    with pytest.raises(ValueError, match="the data broke"):
        next(got)


def test_ahead_stops_its_worker_when_the_consumer_stops():
    produced = []

    def endless():
        while True:
            produced.append(len(produced))
            yield produced[-1]

    got = ahead(endless(), Stages(), depth=2)
    assert [next(got) for _ in range(5)] == [0, 1, 2, 3, 4]
    got.close()
    count = len(produced)
    time.sleep(0.3)
    assert len(produced) == count <= 5 + 2 + 2  # bounded: depth queued, one in hand, none after close


def test_a_run_whose_stages_share_saturated_cores_is_bound_by_the_cpu():
    """No stage busy most of the time, yet the process keeps its cores busy: the stages share the
    cores, and naming the busiest stage would send the user after the wrong one."""
    stages = Stages(cores=2)
    stages.busy.update(data=3.0, model=5.0, out=0.5, writer=6.0)
    cpu_bound = "bound by the CPU: its 2 cores busy 95% with every stage at once"
    assert stages.bound(10**9, wall=10.0, cpu=0.95) == cpu_bound
    stages.busy.update(writer=9.5)  # one stage busy nearly all the time: that stage, whatever the cores do
    assert stages.bound(10**9, wall=10.0, cpu=0.95).startswith("bound by the disk at")
    stages.busy.update(writer=1.0, model=9.0)
    assert stages.bound(10**9, wall=10.0, cpu=0.95) == "bound by the model"


def shares_of(wall: float = 10.0, cpu: float = 0.3, **busy: float) -> str:
    """The bound a run with these busy seconds (over `wall`) and this use of its cores reports."""
    stages = Stages(cores=16, data_bound="bound by tokenization: raise --workers")
    stages.busy.update(busy)
    return stages.bound(4 * 10**9, wall=wall, cpu=cpu)


def test_a_bound_is_named_only_when_a_stage_is_near_saturation():
    """On an H100 a run said "bound by the model" with the model busy 47% of the time and the
    writer 39%: neither set the pace alone. A stage is named at >= 85% of the wall time only."""
    assert shares_of(model=4.7, writer=3.9, data=0.2) == (
        "no stage saturated: the stages wait on each other (model 47%, writer 39%, data 2%)"
    )
    assert shares_of(model=4.1, out=0.4, writer=3.9) == (  # the main thread's out stage counts as the model's
        "no stage saturated: the stages wait on each other (model 45%, writer 39%, data 0%)"
    )
    assert shares_of(model=8.0, out=0.6, writer=3.0) == "bound by the model"
    assert (
        shares_of(model=8.0, writer=8.4) == "no stage saturated: the stages wait on each other "
        "(writer 84%, model 80%, data 0%)"
    )
    assert shares_of(model=2.0, writer=9.0) == "bound by the disk at 444.4 MB/s"  # 4 GB in 9 s of writing
    assert shares_of(model=2.0, writer=9.0, data=9.5) == "bound by tokenization: raise --workers"
    assert shares_of(model=3.0, writer=2.0, data=1.0, cpu=0.9) == (
        "bound by the CPU: its 16 cores busy 90% with every stage at once"
    )


def test_a_writer_waiting_on_the_device_names_the_device():
    """On a GPU the main thread only queues the forward: a run the device bounds shows the model's
    host share low and the writer waiting for the model's results (each batch's copy-out events)."""
    assert shares_of(model=2.0, writer=3.0, device=6.0) == (
        "bound by the device: the writer waited 60% of the time for the model's results"
    )
    # the writer waits some, but it and the device leave it idle half the time: no bound
    assert shares_of(model=4.7, writer=3.9, device=1.0) == (
        "no stage saturated: the stages wait on each other (model 47%, writer 39%, data 0%; "
        "the writer waited for the device 10%)"
    )
    # the waits are not stages: the summary's busy shares leave them out
    stages = Stages()
    stages.busy.update(model=1.0, wait=2.0, device=3.0)
    assert set(stages.shares(10.0)) == {"data", "model", "out", "writer"}


def test_the_writers_wait_for_the_device_is_timed():
    """`Handoff.wait` (the writer's thread, before it reads a CUDA batch) reports the seconds it
    waited on the copy's events: what `bound()` reads as the device's share."""
    from hookscope.extract.copyout import Handoff

    class SlowEvent:  # a CUDA event whose work is still running
        def synchronize(self) -> None:
            time.sleep(0.05)

    waited: list[float] = []
    Handoff([SlowEvent(), SlowEvent()], {}, on_wait=waited.append).wait()
    assert len(waited) == 1 and 0.1 <= waited[0] < 1.0
