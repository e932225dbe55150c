"""Compile policies on the GPT-2-small-shaped random model (8 x 128 tokens, CPU): start-up cost of
`blocks` vs `full`, steady-state capture time against eager, graph breaks and recompiles with
capture hooks on, and cold vs warm compile caches.

    python bench/bench_compile.py [--runs 5] [--cold-repeats 1] [--json bench/out/compile.json]
    python bench/bench_compile.py --interleaved 7 --json bench/out/compile-steady.json

Every configuration runs in a fresh process. "cold" gets an empty TORCHINDUCTOR_CACHE_DIR; "warm"
is a second process on the directory the cold run filled; "mega" is a fresh process on a new empty
directory that first loads the single file `hookscope.compiling.save_cache` wrote in the cold run
(the way to carry compiled code to a new machine or container).

`--interleaved ROUNDS` measures the steady state differently: the three policies on three copies
of the model in one process, taking turns call by call, so that a busy shared machine slows them
alike; it reports medians and the median per-round ratio to eager.

A plain forward (whole model, logits) is timed first; then two points are captured with
`hs.collect` (which stops the forward after the last point): blocks.5.resid_post, whose hook sits
on the block itself and runs eagerly beside the compiled block, and blocks.5.mlp.post, whose hook
is traced into the compiled graph.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

BOUNDARY, TRACED = "blocks.5.resid_post", "blocks.5.mlp.post"


def policy_layer():
    """(the compile-policy module, its compile function): `hookscope.compiling.compile_model`, or
    on a tree from before issue 15 (`--src`), `hookscope.compile.apply`."""
    try:
        from hookscope import compiling

        return compiling, compiling.compile_model
    except ImportError:
        import importlib

        old = importlib.import_module("hookscope.compile")
        return old, old.apply


def phases_of(model, ids) -> dict:
    """What is timed: a plain forward, and a capture at each point."""
    import torch

    import hookscope as hs

    def forward() -> torch.Tensor:
        with torch.inference_mode():  # as captures run: one graph serves both
            return model(ids).logits

    def capture(point: str):
        return lambda: hs.collect(model, ids, point)[point]

    return {"forward": forward, BOUNDARY: capture(BOUNDARY), TRACED: capture(TRACED)}


def child(policy: str, runs: int, save: str | None, load: str | None) -> dict:
    """One configuration, in this (fresh) process."""
    import time

    common.setup_process()
    import torch

    hc, compile_model = policy_layer()
    if load:
        hc.load_cache(load)
    model = common.load_hf()
    ids = common.input_ids(model.config.vocab_size)
    phases = phases_of(model, ids)
    want = {name: fn() for name, fn in phases.items()}  # eager references
    result: dict = {"policy": policy}
    if policy != "off":
        # Inductor's first compile in a cache directory pays a fixed cost whatever the model
        # (about 20 s here, mostly C++ toolchain set-up); measured apart so that blocks vs full
        # compares what the model itself costs.
        start = time.perf_counter()
        torch.compile(lambda x: x * 2 + 1)(torch.ones(4))
        result["inductor_first_use_s"] = time.perf_counter() - start
    hc.reset_stats()
    start = time.perf_counter()
    compile_model(model, policy)
    for name, fn in phases.items():
        got = fn()  # compiles what this call needs
        first = time.perf_counter() - start  # forward: apply + first call; captures: first call
        compiled = hc.compile_stats()
        hc.reset_stats()
        times = common.time_runs(fn, runs=runs, warmup=1)
        steady = hc.compile_stats()
        hc.reset_stats()
        result[name] = {
            "first_s": first,
            "compile_s": compiled["compile_time_s"],  # dynamo + inductor time within first_s
            "graphs": compiled["unique_graphs"],
            "graph_breaks": compiled["graph_breaks"] + steady["graph_breaks"],
            "recompiles_steady": steady["recompiles"],
            "steady_s": times,
            "steady_median_s": common.median(times),
            "max_abs_diff_vs_eager": (got - want[name]).abs().max().item(),
        }
        del got
        start = time.perf_counter()
    if save:
        result["saved_cache"] = str(hc.save_cache(save))
    result["load_average_1m"] = os.getloadavg()[0]  # the machine is shared: how busy it was
    return result


def interleaved(rounds: int) -> dict:
    """Steady state of off / blocks / full in ONE process, taking turns run by run, so that the
    load of a shared machine falls on all three alike (uses the default, warm, compile cache)."""
    import gc
    import time

    common.setup_process()
    hc, compile_model = policy_layer()
    policies = ("off", "blocks", "full")
    models = {policy: compile_model(common.load_hf(), policy) for policy in policies}
    ids = common.input_ids(models["off"].config.vocab_size)
    phases = {policy: phases_of(model, ids) for policy, model in models.items()}
    for by_phase in phases.values():  # compile and warm up
        for fn in by_phase.values():
            fn(), fn()
    hc.reset_stats()
    times: dict = {policy: {name: [] for name in phases[policy]} for policy in policies}
    for _ in range(rounds):
        for name in phases["off"]:
            for policy in policies:
                gc.collect()
                start = time.perf_counter()
                phases[policy][name]()
                times[policy][name].append(time.perf_counter() - start)
    stats = hc.compile_stats()
    return {
        "rounds": rounds,
        "times_s": times,
        "load_average_1m": os.getloadavg()[0],
        "graph_breaks": stats["graph_breaks"],
        "recompiles": stats["recompiles"],
        "median_ms": {p: {n: common.median(t) * 1e3 for n, t in by.items()} for p, by in times.items()},
        "ratio_vs_off": {
            p: {n: ratio(t, times["off"][n]) for n, t in by.items()} for p, by in times.items() if p != "off"
        },
    }


def ratio(compiled: list[float], eager: list[float]) -> float:
    """Median over rounds of compiled / eager time within the same round."""
    return common.median([c / e for c, e in zip(compiled, eager, strict=True)])


def run(policy: str, cache: Path, runs: int, save: Path | None = None, load: Path | None = None) -> dict:
    args = ["--child", policy, "--runs", str(runs)]
    args += ["--save", str(save)] if save else []
    args += ["--load", str(load)] if load else []
    return common.run_fresh(
        sys.executable, Path(__file__), args, env={"TORCHINDUCTOR_CACHE_DIR": str(cache)}, timeout=3600
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--child")
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--runs", type=int, default=5, help="timed captures per configuration")
    parser.add_argument("--cold-repeats", type=int, default=1, help="cold-cache processes per policy")
    parser.add_argument("--json", default=str(common.OUT_DIR / "compile.json"))
    parser.add_argument("--report", action="store_true", help="only print the table of an earlier --json")
    parser.add_argument(
        "--interleaved",
        type=int,
        metavar="ROUNDS",
        help="instead: steady state of all policies in one process, taking turns",
    )
    parser.add_argument("--src", metavar="DIR", help="time the hookscope in DIR/src (another checkout)")
    args = parser.parse_args()
    if args.src:
        common.use_source(args.src)
    if args.child:
        common.emit(child(args.child, args.runs, args.save, args.load))
        return
    if args.interleaved:
        common.ensure_models()
        result = interleaved(args.interleaved)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(
            json.dumps(
                {
                    k: result[k]
                    for k in ("median_ms", "ratio_vs_off", "graph_breaks", "recompiles", "load_average_1m")
                },
                indent=1,
            )
        )
        return
    if args.report:
        report(json.loads(Path(args.json).read_text()))
        return

    common.ensure_models()
    with tempfile.TemporaryDirectory(prefix="hookscope-compile-bench-") as tmp:
        results = run_all(Path(tmp), args.runs, args.cold_repeats)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    report(results)


def run_all(root: Path, runs: int, cold_repeats: int) -> dict:
    """Every configuration, each in a fresh process, with its cache directory under `root`."""
    results: dict = {"off": run("off", root / "unused", runs)}
    for policy in ("blocks", "full"):
        colds = []
        for i in range(cold_repeats):
            mega = root / f"{policy}-mega.bin" if i == 0 else None
            colds.append(run(policy, root / f"{policy}-cold-{i}", runs, save=mega))
        results[f"{policy}/cold"] = colds
        results[f"{policy}/warm"] = run(policy, root / f"{policy}-cold-0", runs)
        mega = root / f"{policy}-mega.bin"
        results[f"{policy}/mega"] = run(policy, root / f"{policy}-mega-dir", runs, load=mega)
    return results


def report(results: dict) -> None:
    """One line per configuration (cold~: medians over the cold repeats). Columns: inductor's fixed
    first-use seconds; per phase, seconds to the first call (compile included), dynamo + inductor
    seconds within it, and the steady median in ms; then graph breaks, steady-state recompiles and
    the largest difference from eager."""
    phases = ("forward", BOUNDARY, TRACED)

    def row(name: str, r: dict) -> None:
        if "error" in r:
            print(f"{name:<12} ERROR {r['error'][:400]}")
            return
        cells = [f"{r.get('inductor_first_use_s', 0):7.1f}"]
        for p in phases:
            first, compiled, steady = r[p]["first_s"], r[p]["compile_s"], r[p]["steady_median_s"] * 1e3
            cells.append(f"{first:7.1f} {compiled:7.1f} {steady:7.0f}")
        breaks = sum(r[p]["graph_breaks"] for p in phases)
        recompiles = sum(r[p]["recompiles_steady"] for p in phases)
        diff = max(r[p]["max_abs_diff_vs_eager"] for p in phases)
        print(f"{name:<12} {' | '.join(cells)} | {breaks:6} {recompiles:6} {diff:9.1e}")

    head = " | ".join(f"{p[:22]:^23}" for p in phases)
    print(f"{'':<12} {'inductor':>7} | {head} |")
    sub = " | ".join(f"{'first s':>7} {'compile':>7} {'ms':>7}" for _ in phases)
    print(f"{'config':<12} {'1st use':>7} | {sub} | {'breaks':>6} {'recomp':>6} {'max diff':>9}")
    row("off", results["off"])
    for policy in ("blocks", "full"):
        colds = results[f"{policy}/cold"]
        for i, r in enumerate(colds):
            row(f"{policy} cold{i}", r)
        if len(colds) > 1 and not any("error" in r for r in colds):
            row(f"{policy} cold~", median_of(colds))
        row(f"{policy} warm", results[f"{policy}/warm"])
        row(f"{policy} mega", results[f"{policy}/mega"])


def median_of(runs: list[dict]) -> dict:
    """Per-figure medians over repeated runs of one configuration."""

    def merge(values: list):
        if isinstance(values[0], dict):
            shared = [key for key in values[0] if all(key in v for v in values)]
            return {key: merge([v[key] for v in values]) for key in shared}
        if isinstance(values[0], (int, float)):
            return common.median(values)
        return values[0]

    return merge(runs)


if __name__ == "__main__":
    main()
