"""The one extraction loop: a source (hookscope.sources) -> capture -> sharded store, for every
kind of source alike.

One forward pass per batch captures every point (stopped after the last one); the writer thread
turns captures into shards while the next batch computes. Re-running the same command resumes:
batches already committed to the manifest are skipped, exactly once. Under `torchrun`, batch i
goes to rank i % world_size; each rank writes its own shards and rank 0 merges the manifests. A
resume may use another number of processes: the batches not yet committed are dealt among them
(store/resume.py), and the finished store holds the same rows. Under `--tp N` each N consecutive
ranks share one tensor-parallel model (TP x DP): the groups take the ranks' places in the deal, and
each group's first rank writes its rows (`Run`).
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from ..errors import DataError
from ..extract_config import ExtractConfig, Run, validate_config
from ..loading import load
from ..loading.allocator import keeping_freed_memory, registering_pinned_memory
from ..model_inputs import unpadded
from ..progress import RowsBar, mib_written
from ..sources import Batches, Rows, Source, source_for
from ..store import ShardWriter, merge_rank_manifests
from ..store.opening import StoreView
from .copyout import CopyOut, Handoff
from .lending import Lender, LendingCapture
from .outcome import ExtractInterrupted, ExtractSummary, check_finite, signals_interrupt
from .stacking import Groups, stack_groups, stacked
from .stages import Stages, ahead, writer_queue


class Executor(Protocol):
    """The executor seam: an executor is made with the opened source, the model, the points, the
    storage dtype and the run (rank, device), and `run(batches)` gets this rank's batches still to
    do, as (index, batch) in index order, and must yield (index, batch, rows) for every one of
    them in the same order, writing nothing: the loop owns the rest (which batches are done, the
    writer, the non-finite check, signals, progress), so any executor keeps the store's promises.
    `lender` lends the host buffers a capture on the CPU may write its kept rows into (copyout.py,
    lending.py); `on_stage` is told where a long step is (a streamed run's block), for the bar.

    The executors own the extraction's forward: a source gives the inputs and makes the rows.
    `InMemory` runs one batch at a time; a block-streamed executor (`streamed.py`, under
    `max_memory`) reads a chunk of batches ahead and runs each block over all of them (only
    sources whose `streamable` is True); a generating executor (`generating.py`) runs the sources
    whose rows come from a generation (`generates`); a vLLM executor (`served.py`, `engine`) sends
    the batches' sequences to a vLLM engine as requests."""

    run_on: Run

    def run(
        self, batches: Batches, *, lender: Lender | None = None, on_stage: Callable[[str], None] | None = None
    ) -> Iterator[tuple[int, dict[str, Tensor], Rows]]: ...


class InMemory:
    """The executor that holds the whole model and runs one batch at a time (see `Executor`)."""

    def __init__(
        self, source: Source, model: torch.nn.Module, points: Sequence[str], dtype: torch.dtype, run: Run
    ):
        self.source = source
        self.model = model
        self.points = points
        self.dtype = dtype
        self.run_on = run

    def run(
        self, batches: Batches, *, lender: Lender | None = None, on_stage: Callable[[str], None] | None = None
    ) -> Iterator[tuple[int, dict[str, Tensor], Rows]]:
        for index, batch in batches:
            yield index, batch, self.forward(batch, lender)

    def forward(self, batch: dict[str, Tensor], lender: Lender | None = None) -> Rows:
        """One capture of every point over the batch's model call; the source makes the rows."""
        device, points = self.run_on.device, self.points
        call = self.source.call_of(batch, device)
        inputs = {k: v.to(device, non_blocking=True) for k, v in call.inputs.items()}
        # kept where the model ran (the loop takes statistics there, then copies to the host); the
        # mask stays on the CPU, where the capture finds the kept rows without waiting for the device
        with (
            LendingCapture(
                self.model, list(points), lender=lender, token_mask=call.keep, dtype=self.dtype
            ) as cap,
            unpadded(call.unpadded),
        ):
            cap.run(inputs)
            acts = {name: cap[name] for name in points}
        return self.source.rows_of(batch, call, acts)


def extract(cfg: ExtractConfig) -> ExtractSummary:
    """Run the extraction described by `cfg`; see the module docstring.

    Everything that can be checked is checked before the store is touched (arguments, the model,
    the points, the data source's first batch to do and its forward pass), so a refused run leaves
    no trace on disk. SIGINT / SIGTERM raise `ExtractInterrupted` after committing whole shards only.
    Process-wide settings changed while it runs, and put back at the end (docs/architecture.md,
    "Process-wide settings"): those `hs.load` changes; while the batches run, glibc's malloc keeps
    freed memory for the next batch (`loading.allocator.keeping_freed_memory`; not under
    `max_memory`, nor when a `MALLOC_*` variable is set); on CUDA with
    `HOOKSCOPE_PIN_BY_REGISTER=1`, PyTorch's pinned allocator registers memory.

    Returns:
        ExtractSummary: rows in the store, rows this run wrote, batches done and skipped, time, bytes.

    Raises:
        HookscopeError: an argument out of range (dtype, sizes, no points, empty `out`).
        ModelLoadError: a model that cannot be loaded.
        UnknownPointError: a point the model does not have.
        DataError: data that is missing, empty or malformed.
        StoreError: a store at `out` written with other settings (never mixed), or damaged.
        ExtractInterrupted: SIGINT / SIGTERM (Ctrl-C); the same call resumes where it stopped."""
    validate_config(cfg)
    kind = source_for(cfg)  # refuses options the source cannot honour, nothing loaded yet
    if cfg.engine is not None:
        from .served import check_config

        check_config(cfg, kind)
    with signals_interrupt():
        try:
            return _extract(cfg, kind)
        except ExtractInterrupted:
            raise
        except KeyboardInterrupt:  # before the store was opened: no row of this run is in it
            raise ExtractInterrupted(0, str(cfg.out)) from None


def _start(cfg: ExtractConfig, kind: type[Source]) -> tuple[Source, Executor, list[str]]:
    """The opened source, the executor (the process's rank and device, the model) and the points
    resolved: nothing written."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world_size > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if cfg.device.startswith("cuda") else "gloo")
    device = (
        f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        if cfg.device == "cuda" and world_size > 1
        else cfg.device
    )
    streamed = cfg.max_memory is not None  # then the weights stay on meta until a block runs
    served = cfg.engine is not None  # then the engine reads the weights: the model here stays on meta
    if served:
        from .served import VllmEngine, model_dir
    loaded = load(
        model_dir(cfg) if served else cfg.model,
        device="meta" if streamed or served else device,
        revision=cfg.revision,
        device_map=cfg.device_map,
        tokenizer=kind.needs_tokenizer,
        # only the weights the points need (under --tp, each rank's slices of them; a generating
        # source and a served run load the whole model)
        points=cfg.points if kind.streamable and not (streamed or served) else None,
        tp=cfg.tp,
    )
    if cfg.device_map is not None:  # inputs go where the embeddings live
        device = str(_input_device(loaded.model))
    run = Run.of_process(rank, world_size, device, cfg.tp)
    points = [s.name for s in loaded.arch.resolve(cfg.points)]  # unknown names fail before any work
    source = kind.open(cfg, loaded, points, run)
    if served:
        return source, VllmEngine(source, loaded, points, getattr(torch, cfg.dtype), run, cfg), points
    if streamed:
        from .streamed import Streamed

        return source, Streamed(source, loaded, points, getattr(torch, cfg.dtype), run, cfg), points
    if kind.generates:
        from .generating import Generating

        return source, Generating(source, loaded.model, points, getattr(torch, cfg.dtype), run), points
    return source, InMemory(source, loaded.model, points, getattr(torch, cfg.dtype), run), points


def _input_device(model: torch.nn.Module) -> torch.device:
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embeddings = model
    return next(embeddings.parameters()).device


def _extract(cfg: ExtractConfig, kind: type[Source]) -> ExtractSummary:
    # on CUDA the host memory a run page-locks (the out stage's ring, a streamed run's block slots)
    # is pinned faster by registering it (loading/allocator.py)
    on_cuda = cfg.device.startswith("cuda") or (cfg.device_map is not None and torch.cuda.is_available())
    with registering_pinned_memory(enabled=on_cuda):
        source, executor, points = _start(cfg, kind)
        # the model loaded: from here on each batch's fresh activations reuse the last batch's memory
        # (loading/allocator.py); not under --max-memory, whose freed block weights must leave the process
        with keeping_freed_memory(enabled=cfg.max_memory is None):
            return _run(cfg, source, executor, points)


@dataclass
class _Tally:
    """What one rank's run did, batch by batch."""

    done: int = 0  # batches run and written
    skipped: int = 0  # batches found committed by an earlier run
    new_rows: int = 0  # rows this run wrote


class _Progress:
    """The bar of one rank's run: its rows, the source's estimate of the total, and a note of the
    bytes written and the stages' busy shares (the writer's once the store is open)."""

    def __init__(self, source: Source, stages: Stages, enabled: bool):
        self.source = source
        self.stages = stages
        self.started = time.perf_counter()
        self.bar = RowsBar("extract", enabled=enabled)
        self.writer: ShardWriter | None = None

    def note(self) -> str:
        written = self.writer.bytes_written if self.writer else 0
        wall = time.perf_counter() - self.started
        self.stages.busy["writer"] = self.writer.busy_seconds if self.writer else 0.0
        rate = written / wall / 1e6 if wall > 0 else 0
        return f"{mib_written(written)}, {rate:,.0f} MB/s, " + self.stages.describe(written, wall)

    def advance(self, rows: int, batch: dict[str, Tensor]) -> None:
        if self.bar.enabled:
            total = self.source.estimate(self.bar.count + rows, batch)
            self.bar.update(rows, total=total, note=self.note())

    def close(self) -> None:
        self.bar.close(note=self.note(), complete=True)


def _pending(
    batches: Batches, done: set[int], source: Source, tally: _Tally, progress: _Progress
) -> Iterator[tuple[int, dict[str, Tensor]]]:
    """The batches still to do; those an earlier run committed are counted and shown, not run."""
    for index, batch in batches:
        if index in done:
            tally.skipped += 1
            progress.advance(source.rows_in(batch) or 0, batch)
        else:
            yield index, batch


def _run(cfg: ExtractConfig, source: Source, executor: Executor, points: list[str]) -> ExtractSummary:
    """The batches through the executor into the store: everything after the model is loaded. A
    rank that does not write (a tensor-parallel group's other ranks) runs the same batches and
    passes its rows by."""
    rank, world_size, writes = executor.run_on.rank, executor.run_on.world_size, executor.run_on.writes
    groups = stack_groups(cfg.points, points) if cfg.stack else {}
    # the stacking is a setting only when asked for: every other store's settings stay as they were
    settings = {**source.settings(), **({"stacked": groups} if groups else {})}
    # which batches this rank goes through and which it skips: the store read once, nothing written
    # yet (the writer opened below checks that nobody wrote since)
    view = StoreView.read(cfg.out, settings, world_size, rank)
    done = view.plan.done(rank)
    # the stages are listed in stages.py: data -> model -> out -> writer
    stages = Stages(data_bound=source.bound_by_data)
    ours = _ours(source, view, rank, done, executor.run_on.device, stages)
    first = next(ours, None)
    if first is None and rank == 0:
        raise DataError(source.nothing_to_extract())
    tally = _Tally()
    progress = _Progress(source, stages, enabled=cfg.progress and rank == 0 and writes)
    copy_out = CopyOut(on_wait=functools.partial(stages.add, "device"), groups=groups)
    batches = _pending(itertools.chain([first] if first else [], ours), done, source, tally, progress)
    ran = executor.run(batches, lender=copy_out, on_stage=progress.bar.stage)
    ran = _timed(_checked(ran, cfg.on_nonfinite, stages, copy_out, groups), stages)
    try:
        writer = _write(cfg, settings, view, world_size, ran, tally, progress) if writes else None
        if writer is None:
            _pass_by(cfg, ran, tally)
    finally:
        copy_out.close()
        progress.close()
    seconds = time.perf_counter() - progress.started
    if world_size > 1 or cfg.tp > 1:  # every process of the launch waits for the merge
        _merge_ranks(cfg.out, rank == 0 and writes, world_size)
    if writer is None:
        return ExtractSummary(cfg.out, 0, 0, tally.done, tally.skipped, seconds, 0, {}, wrote=False)
    stages.busy["writer"] = writer.busy_seconds
    return ExtractSummary(
        cfg.out,
        writer.total_rows,
        tally.new_rows,
        tally.done,
        tally.skipped,
        seconds,
        writer.bytes_written,
        dict(writer.nonfinite),
        stages.shares(seconds),
        stages.bound(writer.bytes_written, seconds),
    )


def _ours(
    source: Source, view: StoreView, rank: int, done: set[int], device: str, stages: Stages
) -> Iterator[tuple[int, dict[str, Tensor]]]:
    """This rank's batches, read ahead on the data stage's thread, which also makes each batch
    to do ready for the model (`Source.prepare`)."""
    dealt = (
        (i, b if i in done else source.prepare(b, device))
        for i, b in enumerate(source.batches())
        if view.plan.deal.visits(i, rank)
    )
    return ahead(dealt, stages)


def _write(
    cfg: ExtractConfig,
    settings: dict[str, Any],
    view: StoreView,
    world_size: int,
    ran: Iterator[Done],
    tally: _Tally,
    progress: _Progress,
) -> ShardWriter:
    """The executor's batches into the store. The first batch to do is run before the store is
    opened (a streamed run runs its whole first chunk, so that no block's weights are read one
    extra time): an empty or bad data source, or a point the forward pass never reaches, is
    refused with nothing written. Ctrl-C commits whole shards only, and says how many rows the
    store holds."""
    head = next(ran, None)
    writer = ShardWriter(
        cfg.out,
        settings,
        shard_rows=cfg.shard_rows,
        rank=view.rank,
        world_size=world_size,
        opened=view,  # refuses if another run wrote since the view was read
        queue_size=writer_queue(head[2][0] if head else {}),
    )
    progress.writer = writer
    try:
        with writer:  # on an interrupt it commits whole shards only (see ShardWriter.__exit__)
            for index, batch, (acts, columns), handoff in itertools.chain([head] if head else [], ran):
                writer.write(index, acts, columns, handoff=handoff)
                rows = len(next(iter(columns.values())))
                tally.done += 1
                tally.new_rows += rows
                progress.advance(rows, batch)
    except KeyboardInterrupt:
        raise ExtractInterrupted(writer.total_rows, str(cfg.out)) from None
    return writer


def _pass_by(cfg: ExtractConfig, ran: Iterator[Done], tally: _Tally) -> None:
    """A rank that writes nothing: its batches run (its group's collectives need them), and go."""
    try:
        for _ in ran:
            tally.done += 1
    except KeyboardInterrupt:
        raise ExtractInterrupted(0, str(cfg.out)) from None


def _merge_ranks(out: str, merges: bool, world_size: int) -> None:
    """Every rank's shards written: one process (the first data-parallel rank's writer) merges the
    ranks' manifests into the store's (one rank: it has its manifest already), while all wait."""
    import torch.distributed as dist

    dist.barrier()
    if merges and world_size > 1:
        merge_rank_manifests(out, world_size)
    dist.barrier()


Done = tuple[int, dict[str, Tensor], Rows, Handoff | None]


def _checked(
    ran: Iterator[tuple[int, dict[str, Tensor], Rows]],
    on_nonfinite: str,
    stages: Stages,
    copy_out: CopyOut,
    groups: Groups,
) -> Iterator[Done]:
    """An executor's rows, each batch refused under --on-nonfinite error before it is written,
    stacked (`--stack`), on their way to the host (the `out` stage, copyout.py: nothing waits for a
    device here)."""
    for index, batch, (acts, columns) in ran:
        start = time.perf_counter()
        check_finite(acts, on_nonfinite, index)
        host, handoff = copy_out(stacked(acts, groups, copy_out.slots))
        stages.add("out", time.perf_counter() - start)
        yield index, batch, (host, columns), handoff


def _timed(ran: Iterator[Done], stages: Stages) -> Iterator[Done]:
    """Each batch's time in the executor (the `model` stage): what the main thread spent getting it,
    less the data stage's queue wait and the `out` stage, counted apart."""
    while True:
        start, waited, out = time.perf_counter(), stages.busy.get("wait", 0.0), stages.busy["out"]
        item = next(ran, None)
        if item is None:
            return
        spent = time.perf_counter() - start
        stages.add("model", spent - (stages.busy.get("wait", 0.0) - waited) - (stages.busy["out"] - out))
        yield item
