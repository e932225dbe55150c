"""Turn the profiler's events into rows: one per label (block, block backward, hooked point) and
the top operators.

Self times are computed here rather than read from `FunctionEvent.self_cpu_time_total`: the
profiler's parent/child tree assumes ranges nest, and our backward ranges open and close inside
the autograd engine's per-node ranges (see labels.py). A range's direct children are the
outermost operator events inside it on its thread; our own labels are transparent, so a block's
self time is the time it spent outside any operator (Python, hooks, dispatch).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from torch.autograd import DeviceType

from .labels import BACKWARD_SUFFIX, ENGINE_NODE, HOOK, HOOK_BACKWARD, PREFIX, STEP

US = 1e-6  # profiler times are microseconds


@dataclass(frozen=True)
class Row:
    """Time and memory of one block or hooked point, per profiled step.

    `kind`: "block" (forward), "block backward", "hook" (the user's hooks at a point, forward
    side) or "hook backward" (gradient / module-backward hooks). `cpu_mem_bytes` is the net CPU
    memory allocated inside the range (allocations minus frees). `share` is the fraction of the
    profiled step, on the device clock when there is one (CUDA), else on the CPU clock.
    """

    name: str
    kind: str
    calls: float
    self_s: float
    total_s: float
    cpu_mem_bytes: float
    share: float
    device_s: float | None = None
    device_mem_bytes: float | None = None
    spread: float | None = None  # (slowest - fastest) / median of its per-step times; None: 1 step


@dataclass(frozen=True)
class OpRow:
    """One operator, summed over its calls, per profiled step (from the key_averages view)."""

    name: str
    calls: float
    self_s: float
    total_s: float
    self_cpu_mem_bytes: float
    self_device_s: float | None = None


@dataclass(frozen=True)
class Span:
    """One occurrence of a range on one thread, in microseconds."""

    start: float
    end: float


class ThreadIndex:
    """The CPU events of one thread, sorted by start (outer before inner on equal starts)."""

    def __init__(self, events: list) -> None:
        self.events = sorted(events, key=lambda e: (e.time_range.start, -e.time_range.end))
        self.starts = [e.time_range.start for e in self.events]
        nodes = [e for e in self.events if e.name.startswith(ENGINE_NODE)]
        self.node_starts = [e.time_range.start for e in nodes]
        self.nodes = nodes

    def children(self, span: Span, skip: Any = None) -> list:
        """The outermost non-label events inside `span` (labels are see-through)."""
        out, covered = [], span.start
        i = bisect.bisect_left(self.starts, span.start)
        while i < len(self.events) and self.starts[i] < span.end:
            ev = self.events[i]
            i += 1
            if ev is skip or ev.name.startswith(PREFIX):
                continue
            if ev.time_range.start >= covered and ev.time_range.end <= span.end:
                out.append(ev)
                covered = ev.time_range.end
        return out

    def node_at(self, t: float) -> Span | None:
        """The autograd engine node range that contains time `t`: the last one to start before
        it (a hook fires inside the node being run, not inside one that already finished)."""
        i = bisect.bisect_right(self.node_starts, t) - 1
        if i < 0 or self.nodes[i].time_range.end < t:
            return None
        return Span(self.nodes[i].time_range.start, self.nodes[i].time_range.end)


def backward_span(span: Span, node_at) -> Span:
    """Snap a backward range to engine node boundaries: it opens inside the node that computes
    the block's last op (which belongs to the block: start there) and closes inside the node
    that consumes the block's input gradient (which does not: end where it starts)."""
    start, end = span.start, span.end
    first = node_at(start)
    if first is not None and first.end < end:
        start = first.start
    last = node_at(end)
    if last is not None and last.start > start:
        end = last.start
    return Span(start, end)


def is_block_backward(name: str) -> bool:
    return name.endswith(BACKWARD_SUFFIX) and not name.startswith((HOOK, HOOK_BACKWARD))


def _row_key(label: str) -> tuple[str, str]:
    if label.startswith(HOOK_BACKWARD):
        return label[len(HOOK_BACKWARD) :], "hook backward"
    if label.startswith(HOOK):
        return label[len(HOOK) :], "hook"
    if is_block_backward(label):
        return label[len(PREFIX) : -len(BACKWARD_SUFFIX)], "block backward"
    return label[len(PREFIX) :], "block"


class _Totals:
    def __init__(self) -> None:
        self.calls = 0
        self.total = self.self = self.cpu_mem = self.device = self.device_mem = 0.0
        self.per_step: dict[int, float] = defaultdict(float)  # step index -> total time in it
        self.per_step_device: dict[int, float] = defaultdict(float)


def relative_spread(values: Sequence[float]) -> float | None:
    """(largest - smallest) / median: 0.0 when every value is the same; None for fewer than two."""
    if len(values) < 2:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return (ordered[-1] - ordered[0]) / median if median > 0 else 0.0


def cpu_threads(events: Iterable) -> dict[int, ThreadIndex]:
    by_thread: dict[int, list] = defaultdict(list)
    for ev in events:
        if ev.device_type == DeviceType.CPU and not ev.is_async:
            by_thread[ev.thread].append(ev)
    return {thread: ThreadIndex(evs) for thread, evs in by_thread.items()}


def label_totals(threads: dict[int, ThreadIndex]) -> dict[str, _Totals]:
    """Per label: calls, total, self, memory and device time, summed over the profiled steps."""
    totals: dict[str, _Totals] = defaultdict(_Totals)
    step_starts = sorted(
        ev.time_range.start for index in threads.values() for ev in index.events if ev.name == STEP
    )
    for index in threads.values():
        for ev in index.events:
            if not ev.name.startswith(PREFIX):
                continue
            span = Span(ev.time_range.start, ev.time_range.end)
            if is_block_backward(ev.name):
                span = backward_span(span, index.node_at)
            kids = index.children(span, skip=ev)
            if ev.name == STEP:
                # on CUDA, backward runs on the autograd engine's device thread: count its
                # operators inside the step's interval too
                kids += [k for other in threads.values() if other is not index for k in other.children(span)]
            t = totals[ev.name]
            t.calls += 1
            t.total += span.end - span.start
            t.self += (span.end - span.start) - sum(k.time_range.end - k.time_range.start for k in kids)
            # memory from the range itself, not its children: frees happen between operators
            # (when Python drops a reference), so only the whole interval nets them out
            t.cpu_mem += ev.cpu_memory_usage
            t.device_mem += ev.device_memory_usage
            device = sum(k.device_time_total for k in kids)
            t.device += device
            step = bisect.bisect_right(step_starts, span.start) - 1  # the step this range ran in
            t.per_step[step] += span.end - span.start
            t.per_step_device[step] += device
    return totals


def build_rows(
    totals: dict[str, _Totals], labels: Sequence[str], steps: int, on_device: bool
) -> tuple[list[Row], float, float | None]:
    """Rows for `labels` (every block, in order, even one that never ran), then for each hooked
    point seen; and the profiled step time (CPU, device), per step."""
    step = totals.get(STEP, _Totals())
    step_cpu, step_device = step.total / steps * US, step.device / steps * US
    base = step_device if on_device else step_cpu
    hook_labels = [name for name in totals if name.startswith((HOOK, HOOK_BACKWARD))]
    rows = []
    for label in list(labels) + hook_labels:
        t = totals.get(label, _Totals())
        name, kind = _row_key(label)
        primary = (t.device if on_device else t.total) / steps * US
        per_step = t.per_step_device if on_device else t.per_step
        rows.append(
            Row(
                name=name,
                kind=kind,
                calls=t.calls / steps,
                self_s=t.self / steps * US,
                total_s=t.total / steps * US,
                cpu_mem_bytes=t.cpu_mem / steps,
                share=primary / base if base > 0 else 0.0,
                device_s=t.device / steps * US if on_device else None,
                device_mem_bytes=t.device_mem / steps if on_device else None,
                spread=relative_spread([per_step.get(i, 0.0) for i in range(steps)]) if t.calls else None,
            )
        )
    return rows, step_cpu, (step_device if on_device else None)


def top_ops(threads: dict[int, ThreadIndex], steps: int, on_device: bool, n: int = 15) -> list[OpRow]:
    """Operators by self time (device self time on CUDA), labels and step markers left out."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    for index in threads.values():
        for ev in index.events:
            if ev.name.startswith((PREFIX, "ProfilerStep")):
                continue
            span = Span(ev.time_range.start, ev.time_range.end)
            kids = index.children(span, skip=ev)
            a = acc[ev.name]
            a[0] += 1
            a[1] += span.end - span.start
            a[2] += (span.end - span.start) - sum(k.time_range.end - k.time_range.start for k in kids)
            a[3] += ev.cpu_memory_usage - sum(k.cpu_memory_usage for k in kids)
            a[4] += sum(k.duration for k in ev.kernels)
    key = 4 if on_device else 2
    ranked = sorted(acc.items(), key=lambda item: item[1][key], reverse=True)[:n]
    return [
        OpRow(
            name=name,
            calls=a[0] / steps,
            self_s=a[2] / steps * US,
            total_s=a[1] / steps * US,
            self_cpu_mem_bytes=a[3] / steps,
            self_device_s=a[4] / steps * US if on_device else None,
        )
        for name, a in ranked
    ]
