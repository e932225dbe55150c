"""Probe (issue 15): `with hs.capture(...)` around a full forward vs the plain forward, tiny GPT-2
(3 layers, d_model 64), 1 x 16 tokens, 1 thread. The configurations take turns in rounds of 30
calls within one process, timed in thread CPU time, so a shared machine's load falls on all alike;
prints medians per call and the median over rounds of each configuration / plain in the same round.
A plain `register_forward_hook` that clones the output is the reference for what any hook costs.
Run with PYTHONPATH=<old checkout>/src to time an older hookscope the same way.

    .venv/bin/python bench/probe_small_capture.py [ROUNDS]      # default 60, ~1 min on a quiet core
"""

import os
import statistics
import sys
import time
from pathlib import Path

import torch

import hookscope as hs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_capture_calls import configs  # noqa: E402  (the three calls its count test compares)

torch.set_num_threads(1)
CONFIGS = configs()
for _ in range(50):
    for fn in CONFIGS.values():
        fn()
per_call: dict[str, list[float]] = {name: [] for name in CONFIGS}
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 60):
    for name, fn in CONFIGS.items():
        start = time.thread_time_ns()
        for _ in range(30):
            fn()
        per_call[name].append((time.thread_time_ns() - start) / 30 / 1e3)
line = [f"{hs.__file__}  load {os.getloadavg()[0]:.1f}"]
for name in CONFIGS:
    line.append(f"{name} {statistics.median(per_call[name]):.0f} us")
for name in ("capture", "raw_hook"):
    ratios = [a / b for a, b in zip(per_call[name], per_call["plain"], strict=True)]
    q = statistics.quantiles(ratios, n=4)
    line.append(f"{name}/plain {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})")
print("  ".join(line))
