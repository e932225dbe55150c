"""What hs.profile's block labels cost when no profiler is running.

Every configuration runs in a fresh process (`common.run_fresh`), the two alternating, so
neither inherits the other's allocator or cache state:

1. end to end: forward passes of the GPT-2-small-shaped random model (12 blocks, d_model 768,
   8 x 128 tokens, 2 threads) with the block labels installed (`BlockLabels`, no profiler)
   vs without; the median over processes of each process's median forward, and the ratio.
2. per call: one tiny module called many times with vs without the label hooks, which
   resolves the few microseconds per block call that the end-to-end ratio cannot.

    python bench/bench_profile_labels.py [--runs 7] [--iters 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

CONFIGS = ("plain", "labels")


def worker_forward(config: str, iters: int) -> dict:
    import torch

    from hookscope.arch import arch_of
    from hookscope.profiling.labels import BlockLabels, profiler_enabled

    common.setup_process()
    model = common.load_hf()
    ids = common.input_ids(model.config.vocab_size)
    assert not profiler_enabled()
    labels = BlockLabels(model, arch_of(model)) if config == "labels" else None
    if labels is not None:
        labels.__enter__()
    with torch.inference_mode():
        times = common.time_runs(lambda: model(ids, use_cache=False), runs=iters, warmup=2)
    if labels is not None:
        labels.__exit__(None, None, None)
    return {"median_s": common.median(times), "min_s": min(times)}


def worker_calls(config: str) -> dict:
    import torch

    from hookscope.arch import Arch
    from hookscope.profiling.labels import BlockLabels

    common.setup_process()
    model = torch.nn.Sequential(torch.nn.Identity())
    x = torch.ones(1)
    if config == "labels":
        BlockLabels(model, Arch("bench", {}, ["0"])).__enter__()
    block = model[0]
    per_call = common.per_op_us(lambda: block(x), batches=7, budget_s=0.3, max_reps=100_000)
    return {"per_call_us": common.median(per_call)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="fresh processes per configuration (>= 5)")
    parser.add_argument("--iters", type=int, default=5, help="timed forwards per process")
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, config = args.worker
        common.emit(worker_forward(config, args.iters) if kind == "forward" else worker_calls(config))
        return

    import torch

    common.ensure_models()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}; "
        f"{common.THREADS} threads; load before: {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    forward: dict[str, list[dict]] = {c: [] for c in CONFIGS}
    calls: dict[str, list[float]] = {c: [] for c in CONFIGS}
    script = Path(__file__).resolve()
    for run in range(args.runs):
        for config in CONFIGS if run % 2 == 0 else CONFIGS[::-1]:
            result = common.run_fresh(
                sys.executable, script, ["--worker", "forward", config, "--iters", str(args.iters)]
            )
            if "error" in result:
                raise SystemExit(f"{config}: {result['error']}")
            forward[config].append(result)
            per_call = common.run_fresh(sys.executable, script, ["--worker", "calls", config])
            calls[config].append(per_call["per_call_us"])
        times = ", ".join(f"{c} {forward[c][-1]['median_s'] * 1e3:.1f} ms" for c in CONFIGS)
        print(f"  run {run + 1}: {times} (load {os.getloadavg()[0]:.2f})", flush=True)

    med = {c: common.median([r["median_s"] for r in forward[c]]) for c in CONFIGS}
    best = {c: min(r["min_s"] for r in forward[c]) for c in CONFIGS}
    per_call = {c: common.median(calls[c]) for c in CONFIGS}
    print(
        f"GPT-2-small shape, {common.BATCH}x{common.SEQ}, forward, no profiler running "
        f"({args.runs} processes per configuration, median of {args.iters} forwards in each):"
    )
    for c in CONFIGS:
        medians = [r["median_s"] * 1e3 for r in forward[c]]
        print(
            f"  {c:<7} median {med[c] * 1e3:8.1f} ms   fastest {best[c] * 1e3:8.1f} ms   "
            f"process medians {min(medians):.1f}-{max(medians):.1f} ms"
        )
    print(
        f"  labels / plain: {med['labels'] / med['plain']:.4f} (medians), "
        f"{best['labels'] / best['plain']:.4f} (fastest)"
    )
    extra = per_call["labels"] - per_call["plain"]
    print(
        f"per block call (one tiny module, median of {args.runs} processes): "
        f"plain {per_call['plain']:.2f} us, labelled {per_call['labels']:.2f} us: +{extra:.2f} us, "
        f"{12 * extra:.0f} us per 12-block forward "
        f"= {12 * extra * 1e-6 / med['plain']:.4%} of the plain forward"
    )
    print(f"load after: {os.getloadavg()[0]:.2f}")
    common.emit({"forward_median_s": med, "forward_fastest_s": best, "per_call_us": per_call})


if __name__ == "__main__":
    main()
