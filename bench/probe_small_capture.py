"""Probe (issue 15): `with hs.capture(...)` around a full forward vs the plain forward, tiny GPT-2
(3 layers, d_model 64), 1 x 16 tokens, 1 thread. The configurations take turns in rounds of 30
calls within one process, timed in thread CPU time, so a shared machine's load falls on all alike;
prints medians per call and the median over rounds of each configuration / plain in the same round.
A plain `register_forward_hook` that clones the output is the reference for what any hook costs.
Run with PYTHONPATH=<old checkout>/src to time an older hookscope the same way, or name other
trees (directories holding src/hookscope): each is loaded as a package of its own in this process
and its capture takes its turn beside this one's, so two trees compare within one process.

    .venv/bin/python bench/probe_small_capture.py [ROUNDS]      # default 60, ~1 min on a quiet core
    .venv/bin/python bench/probe_small_capture.py 60 bench/out/trees/77c78bb   # (before_after.py makes it)
"""

import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import hookscope as hs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_capture_calls import capture_call, configs, tiny  # noqa: E402  (the calls its count test compares)


def load_tree(tree: str, index: int):
    """`tree`/src/hookscope imported as the package `hookscope_tree<index>` (its imports are relative)."""
    src = Path(tree).resolve() / "src" / "hookscope"
    spec = importlib.util.spec_from_file_location(
        f"hookscope_tree{index}", src / "__init__.py", submodule_search_locations=[str(src)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


torch.set_num_threads(1)
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 60
MODEL, IDS = tiny()
CONFIGS = configs(MODEL, IDS)
for index, tree in enumerate(sys.argv[2:]):
    other = capture_call(load_tree(tree, index), MODEL, IDS)
    assert torch.equal(other(), CONFIGS["capture"]())
    CONFIGS[f"capture@{Path(tree).name}"] = other
for _ in range(50):
    for fn in CONFIGS.values():
        fn()
per_call: dict[str, list[float]] = {name: [] for name in CONFIGS}
names = list(CONFIGS)
for rnd in range(ROUNDS):
    for name in names[rnd % len(names) :] + names[: rnd % len(names)]:  # the order rotates
        fn = CONFIGS[name]
        start = time.thread_time_ns()
        for _ in range(30):
            fn()
        per_call[name].append((time.thread_time_ns() - start) / 30 / 1e3)
line = [f"{hs.__file__}  load {os.getloadavg()[0]:.1f}"]
for name in CONFIGS:
    line.append(f"{name} {statistics.median(per_call[name]):.0f} us")
for name in names[1:]:
    ratios = [a / b for a, b in zip(per_call[name], per_call["plain"], strict=True)]
    q = statistics.quantiles(ratios, n=4)
    line.append(f"{name}/plain {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})")
print("  ".join(line))
