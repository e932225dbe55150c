"""The extraction pipeline's stages, in one place, and what bounds a run.

    data (a worker thread: read, tokenize, pack `AHEAD` batches ahead of the model)
      -> model (the executor: inputs to the device, the forward with its captures)
      -> out (copyout.py: statistics where the activations are, the copy to the host into reused
         buffers, on a side stream: the main thread never waits for the device)
      -> writer (store/writer.py: a thread measures each batch's statistics as it is queued (those
         not computed on a device), its thread assembles shards, a copy thread writes them to
         disk, checksummed as written; then the commit, on a thread of its own)

Between stages are bounded queues (`AHEAD` batches here, the writer's `queue_size`), so memory stays
flat. `Stages` counts each stage's busy seconds; `bound()` names the stage that sets the pace, when
one is busy nearly all the time, and says that none does otherwise.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")
STAGES = ("data", "model", "out", "writer")
AHEAD = 4  # batches the data worker prepares ahead of the model
WRITER_QUEUE = 4  # batches waiting for the writer...
WRITER_QUEUE_BYTES = 2**30  # ...or 2, where 4 would hold more host memory than this
_END = object()


SATURATED = 0.85  # a share at or above which a stage, or the process's use of its cores, is the bound
# waits, timed beside the stages but none of them: the model's for the data queue, the writer's for
# the device (a CUDA batch's copy to the host, after its forward)
WAITS = ("wait", "device")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass
class Stages:
    """Busy seconds per stage (`data`, `model`, `out`, `writer`) and the waits (`WAITS`) over a
    run's wall time, and the process's CPU time over what its cores could give in that time."""

    # every key from the start: threads add to their own keys while the main thread reads them all
    busy: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES + WAITS, 0.0))
    started: float = field(default_factory=time.perf_counter)
    data_bound: str = "bound by the data"  # the source's words for a run its data stage bounds
    cpu_started: float = field(default_factory=time.process_time)
    cores: int = field(default_factory=_cores)

    def add(self, stage: str, seconds: float) -> None:
        self.busy[stage] = self.busy.get(stage, 0.0) + seconds

    def shares(self, wall: float | None = None) -> dict[str, float]:
        """Each stage's busy seconds over the wall time (the waits counted apart, `WAITS`, left out)."""
        return {k: self.share(k, wall) for k in self.busy if k not in WAITS}

    def share(self, key: str, wall: float | None = None) -> float:
        wall = wall if wall is not None else time.perf_counter() - self.started
        return min(self.busy.get(key, 0.0) / wall, 1.0) if wall > 0 else 0.0

    def cpu_share(self) -> float:
        """The process's CPU seconds (every thread's) over its cores x the wall time, so far."""
        wall = time.perf_counter() - self.started
        return (time.process_time() - self.cpu_started) / (wall * self.cores) if wall > 0 else 0.0

    def bound(self, nbytes: int, wall: float | None = None, cpu: float | None = None) -> str:
        """What set the pace, in words a user can act on. A stage is named only when it is busy
        nearly all the time (`SATURATED`; the model's share includes taking its activations out:
        both run on the main thread). Else: the cores, when the process keeps them busy (`cpu`:
        its share of them, measured when not given) with every stage at once; the device, when the
        writer spent the time waiting for the model's results (`device`, a GPU's) or writing them;
        otherwise no stage set the pace alone, and the line says so with the shares."""
        shares = self.shares(wall)
        main = shares["model"] + shares["out"]
        busiest = {"model": main, "writer": shares["writer"], "data": shares["data"]}
        stage = max(busiest, key=lambda k: busiest[k])
        if busiest[stage] >= SATURATED:
            return self._named(stage, nbytes)
        cpu = self.cpu_share() if cpu is None else cpu
        if cpu >= SATURATED:
            return (
                f"bound by the CPU: its {self.cores} core{'s' if self.cores > 1 else ''} busy "
                f"{100 * min(cpu, 1.0):.0f}% with every stage at once"
            )
        device = self.share("device", wall)
        if device >= busiest["writer"] and device + busiest["writer"] >= SATURATED:
            return (
                f"bound by the device: the writer waited {100 * device:.0f}% of the time for the "
                "model's results"
            )
        listed = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(busiest.items(), key=lambda kv: -kv[1]))
        if device > 0:
            listed += f"; the writer waited for the device {100 * device:.0f}%"
        return f"no stage saturated: the stages wait on each other ({listed})"

    def _named(self, stage: str, nbytes: int) -> str:
        if stage == "data":
            return self.data_bound
        if stage == "writer":
            rate = nbytes / self.busy["writer"] if self.busy["writer"] > 0 else 0.0
            shown = f"{rate / 1e9:.2f} GB/s" if rate >= 1e9 else f"{rate / 1e6:,.1f} MB/s"
            return f"bound by the disk at {shown}"
        return "bound by the model"

    def describe(self, nbytes: int, wall: float | None = None) -> str:
        shares = self.shares(wall)
        return (
            "busy: "
            + ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares.items())
            + "; "
            + self.bound(nbytes, wall)
        )


def writer_queue(acts: Mapping[str, Any]) -> int:
    """How many batches like `acts` (one batch's tensors, by point) wait for the writer. Each holds its
    host buffers, which the ring makes once and keeps, faulted in at the start: with large batches
    (12 points of a 768-wide model, 600 MB a batch) a queue of 2 holds fewer of them than 4 and
    costs the main thread less system CPU, for no fewer tokens/s (bench/HISTORY.md, Writer, "The
    writer's queue in bytes")."""
    batch_bytes = sum(a.nbytes for a in acts.values())
    return WRITER_QUEUE if WRITER_QUEUE * batch_bytes <= WRITER_QUEUE_BYTES else 2


def ahead(items: Iterable[T], stages: Stages, depth: int = AHEAD) -> Iterator[T]:
    """`items`, produced by a worker thread up to `depth` ahead of the consumer; the worker's time
    counts as the data stage's. An error in the worker is raised here, in order."""
    out: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def work() -> None:
        source = iter(items)
        try:
            while not stop.is_set():
                start = time.perf_counter()
                try:
                    item = next(source)
                except StopIteration:
                    break
                stages.add("data", time.perf_counter() - start)
                while not stop.is_set():
                    try:
                        out.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            out.put((_END, e))
            return
        out.put((_END, None))

    worker = threading.Thread(target=work, name="hookscope-data", daemon=True)
    worker.start()
    try:
        while True:
            start = time.perf_counter()
            item, error = out.get()
            stages.add("wait", time.perf_counter() - start)
            if item is _END:
                if error is not None:
                    raise error
                return
            yield item
    finally:
        stop.set()
        while worker.is_alive():  # let it see the stop: drain what it is blocked putting
            try:
                out.get(timeout=0.1)
            except queue.Empty:
                pass
