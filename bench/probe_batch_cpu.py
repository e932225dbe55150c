"""The CPU cost of one batch's work outside the writer's I/O, on the CPU (issue 34): the statistics
of a point's rows (`PointStats.of` with the writer's reused `Workspace`) and the capture's gather
of a point's kept rows into a lent buffer, cast on the way (`select_tokens(out=)`), for a
32 x 1024 x 768 batch (float32 activations kept as bfloat16, one document start in 800 dropped).
CPU seconds (every thread's) and minor page faults per call, medians over repeated calls.

    PYTHONPATH=src python bench/probe_batch_cpu.py            # this tree
    PYTHONPATH=/other/tree/src python bench/probe_batch_cpu.py  # another, to compare (fresh processes)
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch

import hookscope
from hookscope.store.stats import PointStats, Workspace
from hookscope.token_rows import KeptRows, select_tokens


def measure(fn, calls: int) -> tuple[float, float]:
    """Median CPU ms per call, and minor faults per call."""
    fn()
    cpu, faults = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        started = time.process_time()
        fn()
        cpu.append(time.process_time() - started)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return statistics.median(cpu) * 1e3, faults / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    batch, pos, width = 32, 1024, 768
    g = torch.Generator().manual_seed(0)
    acts = torch.randn(batch, pos, width, generator=g) * 3 + torch.linspace(-50, 50, width)
    keep = torch.ones(batch, pos, dtype=torch.bool)
    keep.view(-1)[::800] = False
    rows = acts[keep].to(torch.bfloat16)
    buffer = torch.empty(rows.shape, dtype=torch.bfloat16)
    work = Workspace()
    stats_ms, stats_faults = measure(lambda: PointStats.of(rows, work), args.calls)
    copy_ms, copy_faults = measure(
        lambda: select_tokens(acts, keep, 1, KeptRows(), torch.bfloat16, lambda shape, dtype, device: buffer),
        args.calls,
    )
    n = len(rows)
    tree = hookscope.__file__.rsplit("/src/", 1)[0]
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"{tree}: {n:,} rows x {width}, {args.threads} threads, OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}: statistics {stats_ms:.1f} ms CPU "
        f"({stats_ms * 1e3 / n:.2f} us/row, {stats_faults:.0f} faults), capture into a buffer "
        f"{copy_ms:.1f} ms CPU ({copy_ms * 1e3 / n:.2f} us/row, {copy_faults:.0f} faults) per batch; "
        f"load {load}"
    )


if __name__ == "__main__":
    main()
