"""Write the Chrome / Perfetto trace, with our backward ranges snapped to engine node boundaries
(the same correction the rows get, so the picture and the table agree and ranges nest)."""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from .events import Span, backward_span, is_block_backward
from .labels import ENGINE_NODE, PREFIX


def write_trace(profiler: Any, path: Path) -> Path:
    profiler.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    nodes: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for ev in events:
        if ev.get("ph") == "X" and str(ev.get("name", "")).startswith(ENGINE_NODE):
            start = float(ev["ts"])
            nodes[(ev.get("pid"), ev.get("tid"))].append((start, start + float(ev["dur"])))
    for spans in nodes.values():
        spans.sort()
    for ev in events:
        name = str(ev.get("name", ""))
        if ev.get("ph") != "X" or ev.get("cat") != "user_annotation" or not name.startswith(PREFIX):
            continue
        if not is_block_backward(name):
            continue
        spans = nodes.get((ev.get("pid"), ev.get("tid")), [])
        starts = [s for s, _ in spans]

        def node_at(t: float, spans=spans, starts=starts) -> Span | None:
            i = bisect.bisect_right(starts, t) - 1
            return Span(*spans[i]) if i >= 0 and spans[i][1] >= t else None

        span = backward_span(Span(float(ev["ts"]), float(ev["ts"]) + float(ev["dur"])), node_at)
        ev["ts"], ev["dur"] = span.start, span.end - span.start
    path.write_text(json.dumps(trace))
    return path
