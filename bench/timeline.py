"""A timeline of one extraction's pipeline, so that a benchmark's figure explains itself: each
stage's time per batch (data, model, out, the main thread's wait on the writer's queue), each
shard's copy into its file, its fsync + rename + commit and the writer's wait for it, the host
rings (buffers made, made ahead, the most out at once), and on CUDA the pinned allocator's own
count and time of cudaHostAlloc calls.

    with Timeline() as timeline:
        summary = extract(cfg)
    report = timeline.summary(summary.seconds)

It wraps the pipeline's functions for the duration of the `with` (nothing in the library changes):
a bench measures with it, a user's run never pays for it.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any


class Timeline:
    def __init__(self) -> None:
        self.events: list[tuple[str, float, float]] = []  # (what, end, seconds), from any thread
        self.copy_outs: list[Any] = []
        self._undo: list[tuple[Any, str, Any]] = []
        self._host_before: dict[str, float] = {}

    def _record(self, what: str, seconds: float) -> None:
        self.events.append((what, time.perf_counter(), seconds))

    def _wrap(self, owner: Any, name: str, what: str) -> None:
        original = getattr(owner, name)
        record = self._record

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                record(what, time.perf_counter() - start)

        self._undo.append((owner, name, original))
        setattr(owner, name, timed)

    def __enter__(self) -> Timeline:
        from hookscope.extract import copyout, stages
        from hookscope.store import writer

        record, copy_outs = self._record, self.copy_outs
        add, init = stages.Stages.add, copyout.CopyOut.__init__

        def add_and_record(self_, stage: str, seconds: float) -> None:
            record(stage, seconds)
            add(self_, stage, seconds)

        def init_and_keep(self_, *args, **kwargs) -> None:
            init(self_, *args, **kwargs)
            copy_outs.append(self_)

        self._undo += [(stages.Stages, "add", add), (copyout.CopyOut, "__init__", init)]
        stages.Stages.add, copyout.CopyOut.__init__ = add_and_record, init_and_keep
        self._wrap(writer, "save_columns", "shard_copy")  # the writer thread: a shard into its file
        self._wrap(writer.ShardWriter, "_wait_commit", "commit_wait")  # ... waiting for the one before
        self._wrap(writer.ShardWriter, "_put_and_commit", "commit")  # commit thread: fsync, rename, journal
        self._wrap(writer.ShardWriter, "_take", "writer_take")  # the writer thread's work per batch
        self._wrap(writer.ShardWriter, "write", "put")  # the main thread, blocked on a full queue
        opened = writer.ShardWriter.__init__
        wrap = self._wrap

        def init_and_time_the_queue(self_, *args, **kwargs) -> None:
            opened(self_, *args, **kwargs)
            wrap(self_._queue, "get", "writer_wait")  # the writer thread, waiting for a batch

        self._undo.append((writer.ShardWriter, "__init__", opened))
        writer.ShardWriter.__init__ = init_and_time_the_queue
        self._host_before = _host_stats()
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.ended = time.perf_counter()
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo = []
        self._host_after = _host_stats()

    def summary(self, run_seconds: float | None = None) -> dict[str, Any]:
        """Per kind of event: count, total, median / 90th percentile / max / first (ms), each batch's
        (ms, up to 400); when the first batch went to the writer and the first shard was committed,
        the tail after the last batch, the writer's idle time, the rings and the pinned allocator."""
        start = min((end - s for _, end, s in self.events), default=self.started)
        end = self.ended
        out: dict[str, Any] = {"span_s": end - start, "run_s": run_seconds}
        by: dict[str, list[tuple[float, float]]] = {}
        for what, stop, seconds in self.events:
            by.setdefault(what, []).append((stop, seconds))
        kinds = {}
        for what, items in by.items():
            items.sort()
            ms = [1e3 * s for _, s in items]
            kinds[what] = {
                "n": len(ms),
                "total_s": sum(ms) / 1e3,
                "median_ms": statistics.median(ms),
                "p90_ms": sorted(ms)[int(0.9 * (len(ms) - 1))],
                "max_ms": max(ms),
                "first_ms": ms[0],
                "each_ms": [round(x, 1) for x in ms[:400]],
            }
        out["kinds"] = kinds
        puts, commits = by.get("put", []), by.get("commit", [])
        if puts:
            out["first_put_s"] = puts[0][0] - start  # the first batch at the writer: the start-up
            out["tail_s"] = end - puts[-1][0]  # after the last batch: the last shard and the close
        if commits:
            out["first_commit_s"] = commits[0][0] - start
        if "writer_wait" in kinds:  # less its last wait, for the close
            out["writer_idle_s"] = kinds["writer_wait"]["total_s"] - by["writer_wait"][-1][1]
        out["rings"] = [
            {
                "made": r.made,
                "made_ahead": getattr(r, "made_ahead", None),
                "most_out": r.most_out,
                "waited_s": getattr(r, "waited", None),
            }
            for c in self.copy_outs
            for r in (c.ring, getattr(c, "host", None))
            if r and r.made
        ]
        out["pinned"] = {k: self._host_after[k] - self._host_before.get(k, 0) for k in self._host_after}
        out["threads"] = threading.active_count()
        return out


def _host_stats() -> dict[str, float]:
    """torch.cuda.host_memory_stats()'s cudaHostAlloc count and time (us), where there is one."""
    try:
        import torch

        if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
            return {}
        stats = torch.cuda.host_memory_stats()
    except Exception:  # noqa: BLE001 - a report's extra, never the run's failure
        return {}
    return {k: float(stats[k]) for k in ADDITIVE if isinstance(stats.get(k), int | float)}


# the counters a run's share is the difference of (the allocator's are per process)
ADDITIVE = (
    "num_host_alloc",
    "num_host_free",
    "host_alloc_time.total",
    "host_alloc_time.count",
    "host_free_time.total",
    "allocated_bytes.allocated",
)


def line(t: dict[str, Any]) -> str:
    """The timeline in one line of a results table."""
    k = t.get("kinds", {})

    def med(name: str) -> str:
        return f"{k[name]['median_ms']:.0f}" if name in k else "-"

    parts = [
        f"per batch (median ms) model {med('model')}, out {med('out')}, put {med('put')}; "
        f"per shard copy {med('shard_copy')}, commit {med('commit')}, commit wait {med('commit_wait')}"
    ]
    if "first_put_s" in t:
        parts.append(f"first batch at the writer {t['first_put_s']:.2f} s, tail {t['tail_s']:.2f} s")
    if "writer_idle_s" in t:
        parts.append(f"writer idle {t['writer_idle_s']:.2f} s of {t['span_s']:.2f}")
    for r in t.get("rings", []):
        parts.append(f"ring made {r['made']} (ahead {r['made_ahead']}), most out {r['most_out']}")
    pinned = t.get("pinned", {})
    calls = pinned.get("num_host_alloc")
    if calls is not None:
        spent = pinned.get("host_alloc_time.total", 0.0) / 1e6
        pinned_gb = pinned.get("allocated_bytes.allocated", 0.0) / 1e9
        parts.append(f"cudaHostAlloc {calls:.0f} calls, {pinned_gb:.1f} GB, {spent:.2f} s")
    return "; ".join(parts)
