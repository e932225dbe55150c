"""The extraction benchmarks of issue 3, side by side, each run in a fresh process
(bench/extract_cases.py), 2 threads, median of the runs.

    .venv-bench/bin/python bench/bench_extract.py            # full run (~20 min on 2 idle cores)
    .venv-bench/bin/python bench/bench_extract.py --quick    # smoke run
    ... --write-baseline

On the random GPT-2-small-shaped model, blocks.6.resid_post to float16, context 128, batch 8, the
builtin stdlib-docstrings corpus:
1. steady-state tokens/s of `hookscope extract` vs the truncated forward alone (embeddings +
   blocks 0-6 by hand, result discarded): is the disk fully overlapped? (target >= 0.90x)
2. vs a hand-written TransformerLens 3.9 loop, run_with_cache(names_filter=...) + torch.save per
   batch, with and without stop_at_layer
3. peak RSS of the extraction process at 1x, 4x and 16x the tokens, the shard size fixed so that
   16x spans many shards (target: flat, 16x within 10% of 1x)

"Steady state" runs from the end of the first batch to the end of the last one (for extract: until
the writer has flushed and committed every shard), so model load, tokenizer and corpus start-up
are left out on every side; the whole in-process time is reported beside it. Configurations are
interleaved round by round, so a change in the machine's load touches them all alike.
Prints the tables and the change against bench/baseline_extract.json; writes the raw figures to
bench/out/extract-latest.json (and a time-stamped copy).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from bench_core import cpu_name, default_python

CASES_SCRIPT = common.BENCH_DIR / "extract_cases.py"
BASELINE = common.BENCH_DIR / "baseline_extract.json"
CONFIGS = ("floor", "extract", "tl3", "tl3_stop")
MAX_LOAD = 1.5
# libgomp (torch's OpenMP) spins 300,000 rounds (~3 ms) at each wait, but only 100 once a process
# manages more OpenMP threads than there are cores. The store writer's statistics ops start a second
# team, so extract ran throttled and the floor did not; on a busy machine the floor's spinning worker
# took the CPU from its own main thread (measured: the floor 1.5x slower than extract, with 1.7x its
# CPU time; equal on an idle machine). Every configuration runs with the throttled count, so they all
# wait alike whatever the load.
RUN_ENV = {"GOMP_SPINCOUNT": "100"}

# tokens per throughput run (= the 1x of the RSS series), shard rows, runs per configuration,
# RSS scales beyond 1x with their runs
SETTINGS = {
    "full": {
        "tokens": 16384,
        "shard_rows": 8192,
        "runs": {"floor": 5, "extract": 5, "tl3": 3, "tl3_stop": 3},
        "rss": {4: 3, 16: 2},
    },
    "quick": {
        "tokens": 2048,
        "shard_rows": 1024,
        "runs": {"floor": 1, "extract": 1, "tl3": 1, "tl3_stop": 1},
        "rss": {4: 1},
    },
}

TARGETS = [  # (what, ratio key, bound, "min" | "max")
    ("1: extract / truncated forward, steady tokens/s", "extract/floor", 0.90, "min"),
    ("1: the same, median of per-round ratios", "extract/floor.paired", 0.90, "min"),
    ("3: peak RSS, whole process, 4x / 1x tokens", "rss.4x/1x", 1.10, "max"),
    ("3: peak RSS, whole process, 16x / 1x tokens", "rss.16x/1x", 1.10, "max"),
    ("3: peak RSS, steady state, 4x / 1x tokens", "rss.4x/1x.steady", 1.10, "max"),
    ("3: peak RSS, steady state, 16x / 1x tokens", "rss.16x/1x.steady", 1.10, "max"),
]


def run_case(python: str, case: str, tokens: int, shard_rows: int, scratch: Path) -> dict:
    out = scratch / f"{case}-{tokens}-{time.monotonic_ns()}"
    args = [case, "--tokens", str(tokens), "--shard-rows", str(shard_rows), "--out", str(out)]
    return common.run_fresh(python, CASES_SCRIPT, args, env=RUN_ENV)


def wait_for_quiet(minutes: float) -> tuple[float, float, float]:
    """Wait (up to `minutes`) until the 1-minute load average drops below MAX_LOAD."""
    deadline = time.monotonic() + 60 * minutes
    while os.getloadavg()[0] >= MAX_LOAD and time.monotonic() < deadline:
        print(f"load average {os.getloadavg()[0]:.2f} >= {MAX_LOAD}: waiting", flush=True)
        time.sleep(30)
    return os.getloadavg()


def summarise(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Medians per configuration of the measured runs (errors left out)."""
    medians = {}
    for name, results in runs.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            continue
        medians[name] = {
            "runs": len(ok),
            "tokens_per_s": common.median([r["steady_tokens"] / r["steady_s"] for r in ok]),
            "whole_tokens_per_s": common.median([r["tokens"] / r["total_s"] for r in ok]),
            "cpu_us_per_token": common.median([1e6 * r["steady_cpu_s"] / r["steady_tokens"] for r in ok]),
            "total_s": common.median([r["total_s"] for r in ok]),
            "first_batch_s": common.median([r["first_batch_s"] for r in ok]),
            "peak_rss_mib": common.median([r["peak_rss_bytes"] for r in ok]) / 2**20,
            "steady_peak_rss_mib": common.median([r["steady_peak_rss_bytes"] for r in ok]) / 2**20,
            "rss_first_batch_mib": common.median([r["rss_first_batch_bytes"] for r in ok]) / 2**20,
            "tokens": ok[0]["tokens"],
            "shards": ok[0].get("shards"),
        }
    return medians


def rate(result: dict) -> float | None:
    return None if "error" in result else result["steady_tokens"] / result["steady_s"]


def ratios(runs: dict[str, list[dict]], medians: dict[str, dict]) -> dict[str, float]:
    """Ratios of the medians; `.paired`: the median of the per-round ratios (runs of one round are
    neighbours in time, so a change in the machine's load cancels out); `.whole`: whole runs;
    `.cpu`: CPU time per token (all threads of the process)."""
    out = {}
    for other in ("floor", "tl3", "tl3_stop"):
        if "extract" in medians and other in medians:
            ex, ot = medians["extract"], medians[other]
            out[f"extract/{other}"] = ex["tokens_per_s"] / ot["tokens_per_s"]
            # round i of one configuration pairs with round i of the other (tl3 runs fewer rounds)
            rounds = zip(runs["extract"], runs[other], strict=False)
            pairs = [rate(a) / rate(b) for a, b in rounds if rate(a) and rate(b)]
            out[f"extract/{other}.paired"] = common.median(pairs)
            out[f"extract/{other}.whole"] = ex["whole_tokens_per_s"] / ot["whole_tokens_per_s"]
            out[f"extract/{other}.cpu"] = ex["cpu_us_per_token"] / ot["cpu_us_per_token"]
    one = medians.get("extract")
    for name, m in medians.items():
        if name.startswith("rss.") and one:
            out[f"{name}/1x"] = m["peak_rss_mib"] / one["peak_rss_mib"]
            out[f"{name}/1x.steady"] = m["steady_peak_rss_mib"] / one["steady_peak_rss_mib"]
    return out


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_tables(runs: dict, medians: dict, ratio: dict, baseline: dict) -> None:
    print("\n== 1-2. blocks.6.resid_post -> float16, 8 x 128 per batch (medians; tokens/s steady state)")
    print(
        f"{'config':<10}{'runs':>5}{'tokens/s':>10}{'x floor':>9}{'extract x':>11}{'paired':>8}"
        f"{'CPU us/tok':>12}{'whole tok/s':>13}{'whole s':>9}{'peak RSS MiB':>14}"
    )
    floor = medians.get("floor", {}).get("tokens_per_s")
    for name in CONFIGS:
        m = medians.get(name)
        if m is None:
            print(f"{name:<10}  not measured: {runs[name][0].get('error', '')[:200]}")
            continue
        vs_floor = m["tokens_per_s"] / floor if floor else None
        print(
            f"{name:<10}{m['runs']:>5}{m['tokens_per_s']:>10,.0f}{fmt(vs_floor):>9}"
            f"{fmt(ratio.get(f'extract/{name}')) if name != 'extract' else '':>11}"
            f"{fmt(ratio.get(f'extract/{name}.paired')) if name != 'extract' else '':>8}"
            f"{m['cpu_us_per_token']:>12,.0f}"
            f"{m['whole_tokens_per_s']:>13,.0f}{m['total_s']:>9.1f}{m['peak_rss_mib']:>14,.0f}"
        )
    print(
        "\n== 3. peak RSS of the extraction process, MiB (VmHWM: whole process, weights loading included;"
        "\n   steady: from the end of the first batch on; RSS at the end of the first batch)"
    )
    print(
        f"{'scale':<7}{'tokens':>9}{'shards':>8}{'runs':>6}{'whole':>8}{'x 1x':>7}{'steady':>8}{'x 1x':>7}"
        f"{'1st batch':>11}"
    )
    scales = [("extract", "1x")] + [(k, k.removeprefix("rss.")) for k in medians if k.startswith("rss.")]
    for name, label in scales:
        m = medians.get(name)
        if m:
            whole, steady = (
                (1.0, 1.0) if name == "extract" else (ratio.get(f"{name}/1x"), ratio.get(f"{name}/1x.steady"))
            )
            print(
                f"{label:<7}{m['tokens']:>9,}{m['shards']:>8}{m['runs']:>6}{m['peak_rss_mib']:>8,.0f}"
                f"{fmt(whole, '.3f'):>7}{m['steady_peak_rss_mib']:>8,.0f}{fmt(steady, '.3f'):>7}"
                f"{m['rss_first_batch_mib']:>11,.0f}"
            )
    failed = [f"{k}: {r['error'][:200]}" for k, rs in runs.items() for r in rs if "error" in r]
    if failed:
        print("\nfailed runs: " + "; ".join(failed))
    print("\n== targets")
    for what, key, bound, kind in TARGETS:
        value = ratio.get(key)
        ok = value is not None and (value >= bound if kind == "min" else value <= bound)
        verdict = "n/a" if value is None else ("met" if ok else "MISSED")
        print(f"{what:<52}{fmt(value, '.3f'):>8}  ({'>=' if kind == 'min' else '<='} {bound})  {verdict}")
    if baseline:
        print(f"\n== change against {BASELINE.name} ({baseline.get('meta', {}).get('date', '?')})")
        for key, old in baseline.get("ratios", {}).items():
            new = ratio.get(key)
            if new is not None:
                print(f"{key:<28}{old:>10.3f}{new:>10.3f}{(new / old - 1) * 100:>+9.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: few tokens, one run each, RSS at 1x and 4x"
    )
    parser.add_argument(
        "--python",
        default=default_python(".venv-bench") or sys.executable,
        help="interpreter with hookscope and TransformerLens 3.9",
    )
    parser.add_argument(
        "--wait-load",
        type=float,
        default=None,
        help=f"minutes to wait for a load average < {MAX_LOAD} first (default: 10, quick: 0)",
    )
    parser.add_argument("--write-baseline", action="store_true", help=f"save the ratios to {BASELINE.name}")
    args = parser.parse_args()
    mode = "quick" if args.quick else "full"
    settings = SETTINGS[mode]
    common.OUT_DIR.mkdir(exist_ok=True)
    prepared = common.run_fresh(args.python, CASES_SCRIPT, ["prepare"])
    if "error" in prepared:
        raise SystemExit(f"could not build the benchmark models: {prepared['error']}")
    load = wait_for_quiet(args.wait_load if args.wait_load is not None else (0 if args.quick else 10))
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "mode": mode,
        "threads": common.THREADS,
        "env": RUN_ENV,
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "load_before": load,
        "versions": prepared,
        "settings": settings,
    }
    print(json.dumps(meta, indent=1), flush=True)

    tokens, shard_rows = settings["tokens"], settings["shard_rows"]
    runs: dict[str, list[dict]] = {}
    # scratch under bench/out: the same disk as a real store (not a tmpfs)
    with tempfile.TemporaryDirectory(dir=common.OUT_DIR, prefix="scratch-") as tmp:
        scratch = Path(tmp)
        check_args = ["check", "--out", str(scratch / "check")]
        runs["check"] = [common.run_fresh(args.python, CASES_SCRIPT, check_args, env=RUN_ENV)]
        print("check:", runs["check"][0], flush=True)

        def timed(name: str, case: str, n_tokens: int) -> None:
            start = time.perf_counter()
            result = run_case(args.python, case, n_tokens, shard_rows, scratch)
            runs.setdefault(name, []).append(result)
            shown = result.get("error") or (
                f"{rate(result):,.0f} tokens/s steady, peak RSS {result['peak_rss_bytes'] / 2**20:,.0f} MiB"
            )
            print(f"{name:<10}{time.perf_counter() - start:>7.1f} s  {shown}", flush=True)

        for round_ in range(max(settings["runs"].values())):
            for case in CONFIGS:
                if round_ < settings["runs"][case]:
                    timed(case, case, tokens)
        for scale, n in settings["rss"].items():
            for _ in range(n):
                timed(f"rss.{scale}x", "extract", scale * tokens)
    meta["load_after"] = os.getloadavg()
    medians = summarise({k: v for k, v in runs.items() if k != "check"})
    ratio = ratios(runs, medians)
    baseline = json.loads(BASELINE.read_text()) if BASELINE.exists() else {}
    print_tables(runs, medians, ratio, baseline)

    report = {"meta": meta, "runs": runs, "medians": medians, "ratios": ratio}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for path in (common.OUT_DIR / f"extract-{stamp}.json", common.OUT_DIR / "extract-latest.json"):
        path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {common.OUT_DIR / 'extract-latest.json'}")
    if args.write_baseline:
        BASELINE.write_text(json.dumps({"meta": meta, "medians": medians, "ratios": ratio}, indent=1) + "\n")
        print(f"wrote {BASELINE}")


if __name__ == "__main__":
    main()
