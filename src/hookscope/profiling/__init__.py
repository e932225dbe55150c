"""Profiling: where the time and memory of a step go, per block and per hooked point.

    report = hs.profile(model, ids, backward=True, hooks=[("blocks.3.attn.z", my_hook)])
    print(report.summary())
    report.write("prof/")   # table.txt, trace.json, time_per_block.png, report.html

labels.py puts a `record_function` range on every block (forward and backward) and hooked point,
events.py turns the profiler's events into rows, trace.py writes the trace, render.py the picture
and HTML page, run.py runs the steps.
"""

from .events import OpRow, Row
from .report import ProfileReport
from .run import profile, random_tokens

__all__ = ["OpRow", "ProfileReport", "Row", "profile", "random_tokens"]
