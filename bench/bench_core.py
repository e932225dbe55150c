"""The core benchmarks of issue 2, hookscope and its peers side by side, each configuration in a
fresh process (bench/core_cases.py), 2 threads, median of the runs.

    .venv-bench/bin/python bench/bench_core.py            # full run (~10 min on 2 cores)
    .venv-bench/bin/python bench/bench_core.py --quick    # smoke run, fewer repetitions
    ... --only a,c   ... --write-baseline

a. attach + remove one hook, four hook shapes (bench/hook_shapes.py), per tool
b. capture blocks.5.resid_post of a GPT-2-small shape, 8 x 128 tokens: time and peak extra memory;
   also on a TransformerLens 4 bridge over the same model (hookscope vs the bridge's run_with_cache)
c. 12 no-op hooks vs none on a full forward; and 1 x 16 tokens on a tiny GPT-2 (per-call overhead)

Prints a table of ratios and the change against bench/baseline_core.json; writes the raw figures
to bench/out/core-latest.json (and a time-stamped copy).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from hook_shapes import SHAPES

CASES_SCRIPT = common.BENCH_DIR / "core_cases.py"
BASELINE = common.BENCH_DIR / "baseline_core.json"

A_TOOLS = ("torch", "hookscope", "tl3", "tl3_point", "tl4", "tl4_point")
B_CONFIGS = (
    "floor",
    "hookscope",
    "forward_hook",
    "tl3_full",
    "tl3_filter",
    "tl3_filter_stop",
    "nnsight",
    "nnsight_stop",
    "tl4_hookscope",
    "tl4_full",
    "tl4_filter",
    "tl4_filter_stop",
)
# hookscope on a TransformerLens 4 bridge / the bridge's own run_with_cache (issue 13)
B_BRIDGE_RATIOS = ("tl4_filter", "tl4_filter_stop", "tl4_full")
C_CONFIGS = ("none", "hooks12", "paired")
SMALL_CONFIGS = ("plain", "hook", "capture", "collect", "nnsight", "nnsight_stop")

# Per section: timed runs per process, rounds (processes per configuration, interleaved across
# configurations so that a change in the machine's load falls on all of them alike), seconds per
# timed batch of fast operations, runs of the memory probe (one more process per configuration).
SETTINGS = {
    "full": {
        "a": {"runs": 7, "rounds": 1, "budget": 0.2},
        "b": {"runs": 5, "rounds": 4, "memory_runs": 5},
        "c": {"runs": 5, "rounds": 4},
        "small": {"runs": 5, "rounds": 4, "budget": 0.3},
    },
    "quick": {
        "a": {"runs": 3, "rounds": 1, "budget": 0.02},
        "b": {"runs": 1, "rounds": 2, "memory_runs": 1},
        "c": {"runs": 1, "rounds": 2},
        "small": {"runs": 2, "rounds": 2, "budget": 0.05},
    },
}

TARGETS = [  # (what, ratio key, at most)
    ("a: hookscope partial / bare function", "a.hookscope.partial/function", 1.2),
    ("a: hookscope dataclass / bare function", "a.hookscope.dataclass/function", 1.2),
    ("a: hookscope bound method / bare function", "a.hookscope.method/function", 1.2),
    ("b: hookscope / floor, time", "b.hookscope/floor.time", 1.10),
    ("b: hookscope / floor, peak extra memory", "b.hookscope/floor.memory", 1.2),
    ("c: 12 no-op hooks / no hooks, paired in one process", "c.paired.hooks12/none", 1.03),
]


def default_python(venv: str) -> str | None:
    path = common.REPO_DIR / venv / "bin" / "python"
    return str(path) if path.exists() else None


def plan(sections: set[str], mode: str, b_configs: set[str] | None = None) -> list[tuple[str, str, bool]]:
    """(case, interpreter key, memory probe?) for every process, in the order they run."""
    groups = []
    if "a" in sections:
        groups.append(
            (
                "a",
                [
                    (f"a.{tool}.{shape}", "tl4" if tool.startswith("tl4") else "main")
                    for tool in A_TOOLS
                    for shape in SHAPES
                ],
            )
        )
    if "b" in sections:
        groups.append(
            (
                "b",
                [
                    (f"b.{config}", "tl4" if config.startswith("tl4") else "main")
                    for config in B_CONFIGS
                    if b_configs is None or config in b_configs
                ],
            )
        )
    if "c" in sections:
        groups.append(("c", [(f"c.{config}", "main") for config in C_CONFIGS]))
        groups.append(("small", [(f"small.{config}", "main") for config in SMALL_CONFIGS]))
    processes = []
    for section, cases in groups:
        for _ in range(SETTINGS[mode][section]["rounds"]):
            processes += [(case, key, False) for case, key in cases]
        if section == "b":
            processes += [(case, key, True) for case, key in cases]
    return processes


def run_process(case: str, python: str, mode: str, memory: bool) -> dict:
    section = case.split(".")[0]
    settings = SETTINGS[mode][section]
    if memory:
        args = [case, "--runs", str(settings["memory_runs"]), "--memory"]
    else:
        args = [case, "--runs", str(settings["runs"])]
    if "budget" in settings:
        args += ["--budget", str(settings["budget"])]
    result = common.run_fresh(python, CASES_SCRIPT, args, env=common.MEMORY_ENV if memory else None)
    result["load"] = os.getloadavg()[0]
    return result


def merge(into: dict, result: dict) -> None:
    """Pool one process's runs with the same configuration's earlier processes."""
    for key, value in result.items():
        if isinstance(value, list):
            into.setdefault(key, []).extend(value)
        elif key == "load":
            into.setdefault("loads", []).append(value)
        else:
            into.setdefault(key, value)


def summarise(results: dict) -> dict:
    """Medians per case (and the machine's median 1-minute load while its processes ran)."""
    medians: dict[str, dict] = {}
    for case, result in results.items():
        found = {}
        if "us_per_op" in result:
            found["us"] = common.median(result["us_per_op"])
        if "seconds" in result:
            found["ms"] = 1e3 * common.median(result["seconds"])
        if "pair_ratios" in result:
            found["ratio"] = common.median(result["pair_ratios"])
        if "peak_extra_bytes" in result:
            found["mib"] = common.median(result["peak_extra_bytes"]) / 2**20
        if found and "loads" in result:
            found["load"] = common.median(result["loads"])
        if found:
            medians[case] = found
    return medians


def ratios(medians: dict) -> dict[str, float]:
    out: dict[str, float] = {}

    def put(key: str, num: float | None, den: float | None) -> None:
        if num is not None and den:
            out[key] = num / den

    def get(case: str, unit: str) -> float | None:
        return medians.get(case, {}).get(unit)

    for tool in A_TOOLS:
        for shape in SHAPES:
            put(f"a.{tool}.{shape}/function", get(f"a.{tool}.{shape}", "us"), get(f"a.{tool}.function", "us"))
            if tool != "hookscope":
                put(
                    f"a.{tool}.{shape}/hookscope.{shape}",
                    get(f"a.{tool}.{shape}", "us"),
                    get(f"a.hookscope.{shape}", "us"),
                )
    put(
        "a.hookscope.function/torch.function",
        get("a.hookscope.function", "us"),
        get("a.torch.function", "us"),
    )
    for config in B_CONFIGS:
        put(f"b.{config}/floor.time", get(f"b.{config}", "ms"), get("b.floor", "ms"))
        put(f"b.{config}/floor.memory", get(f"b.{config}", "mib"), get("b.floor", "mib"))
    for peer in B_BRIDGE_RATIOS:
        for unit, what in (("ms", "time"), ("mib", "memory")):
            put(f"b.tl4_hookscope/{peer}.{what}", get("b.tl4_hookscope", unit), get(f"b.{peer}", unit))
    put("c.hooks12/none", get("c.hooks12", "ms"), get("c.none", "ms"))
    if get("c.paired", "ratio") is not None:
        out["c.paired.hooks12/none"] = get("c.paired", "ratio")
    for config in SMALL_CONFIGS:
        put(f"small.{config}/plain", get(f"small.{config}", "us"), get("small.plain", "us"))
    return out


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_a(medians: dict, ratio: dict) -> None:
    print("\n== a. attach + remove one hook (us per op; ratio to the same tool's bare function)")
    print(f"{'tool':<11}" + "".join(f"{s:>22}" for s in SHAPES))
    for tool in A_TOOLS:
        cells = []
        for shape in SHAPES:
            us = medians.get(f"a.{tool}.{shape}", {}).get("us")
            same_tool = ratio.get(f"a.{tool}.{shape}/function")
            cells.append(f"{fmt(us, ',.1f')} ({fmt(same_tool)}x)" if us else "n/a")
        print(f"{tool:<11}" + "".join(f"{c:>22}" for c in cells))


def print_b(medians: dict, ratio: dict, err) -> None:
    print("\n== b. capture blocks.5.resid_post, 8 x 128 (median ms, peak extra MiB; ratios to the floor)")
    print(f"{'config':<17}{'ms':>9}{'x floor':>9}{'MiB':>9}{'x floor':>9}{'load':>6}")
    for config in B_CONFIGS:
        m = medians.get(f"b.{config}", {})
        print(
            f"{config:<17}{fmt(m.get('ms'), '.0f'):>9}{fmt(ratio.get(f'b.{config}/floor.time')):>9}"
            f"{fmt(m.get('mib'), '.1f'):>9}{fmt(ratio.get(f'b.{config}/floor.memory')):>9}"
            f"{fmt(m.get('load'), '.1f'):>6}  {err(f'b.{config}')[:60]}"
        )
    print("\n== b on a TransformerLens 4 bridge: hookscope / the bridge's run_with_cache (time, memory)")
    for peer in B_BRIDGE_RATIOS:
        print(
            f"{'tl4_hookscope / ' + peer:<34}{fmt(ratio.get(f'b.tl4_hookscope/{peer}.time')):>9}"
            f"{fmt(ratio.get(f'b.tl4_hookscope/{peer}.memory')):>9}"
        )


def print_c(medians: dict, ratio: dict, err) -> None:
    print("\n== c. full forward, 8 x 128: no hooks vs 12 no-op hookscope hooks (median ms)")
    for config in ("none", "hooks12"):
        m = medians.get(f"c.{config}", {})
        print(f"{config:<17}{fmt(m.get('ms'), '.1f'):>9}{fmt(m.get('load'), '.1f'):>6}")
    print(f"{'ratio':<17}{fmt(ratio.get('c.hooks12/none'), '.4f'):>9}   (separate processes)")
    print(
        f"{'paired ratio':<17}{fmt(ratio.get('c.paired.hooks12/none'), '.4f'):>9}   "
        "(median of per-pair ratios, both in one process, alternating)"
    )
    print("\n== small: tiny GPT-2, 1 x 16 tokens (us per call; ratio to plain)")
    for config in SMALL_CONFIGS:
        m = medians.get(f"small.{config}", {})
        print(
            f"{config:<17}{fmt(m.get('us'), ',.0f'):>9}{fmt(ratio.get(f'small.{config}/plain')):>9}"
            f"{fmt(m.get('load'), '.1f'):>6}  {err(f'small.{config}')[:60]}"
        )


def print_tables(results: dict, medians: dict, ratio: dict, baseline: dict, sections: set[str]) -> None:
    def err(case: str) -> str:
        r = results.get(case, {})
        return r.get("error") or r.get("skipped") or ""

    if "a" in sections:
        print_a(medians, ratio)
    if "b" in sections:
        print_b(medians, ratio, err)
    if "c" in sections:
        print_c(medians, ratio, err)
    failed = [c for c in results if err(c)]
    if failed:
        print("\nnot measured: " + "; ".join(f"{c}: {err(c)[:200]}" for c in failed))
    print("\n== targets")
    for what, key, limit in TARGETS:
        value = ratio.get(key)
        verdict = "n/a" if value is None else ("met" if value <= limit else "MISSED")
        print(f"{what:<45}{fmt(value, '.3f'):>8}  (<= {limit})  {verdict}")
    if baseline:
        print(f"\n== change against {BASELINE.name} ({baseline.get('meta', {}).get('date', '?')})")
        for key, old in baseline.get("ratios", {}).items():
            new = ratio.get(key)
            if new is not None:
                print(f"{key:<42}{old:>10.3f}{new:>10.3f}{(new / old - 1) * 100:>+9.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: fewer repetitions")
    parser.add_argument("--only", default="a,b,c", help="sections to run, e.g. 'a,c'")
    parser.add_argument(
        "--python",
        default=default_python(".venv-bench") or sys.executable,
        help="interpreter with hookscope, TransformerLens 3.9 and nnsight",
    )
    parser.add_argument(
        "--tl4-python",
        default=default_python(".venv-tl4"),
        help="interpreter with TransformerLens 4.x (TransformerBridge)",
    )
    parser.add_argument(
        "--b-configs",
        default=None,
        help=f"section b: only these configurations, e.g. 'floor,tl4_hookscope,tl4_filter' "
        f"(of {', '.join(B_CONFIGS)})",
    )
    parser.add_argument("--write-baseline", action="store_true", help=f"save the ratios to {BASELINE.name}")
    parser.add_argument(
        "--src",
        metavar="DIR",
        help="time the hookscope in DIR/src (another checkout) "
        "instead of the installed one; bench/before_after.py compares two",
    )
    args = parser.parse_args()
    if args.src:
        common.use_source(args.src)
    mode = "quick" if args.quick else "full"
    sections = set(args.only.split(","))
    common.OUT_DIR.mkdir(exist_ok=True)
    prepared = common.run_fresh(args.python, CASES_SCRIPT, ["prepare"])
    if "error" in prepared:
        raise SystemExit(f"could not build the benchmark models: {prepared['error']}")

    pythons = {"main": args.python, "tl4": args.tl4_python}
    versions = {key: common.run_fresh(py, CASES_SCRIPT, ["versions"]) for key, py in pythons.items() if py}
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "mode": mode,
        "threads": common.THREADS,
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "load_before": os.getloadavg(),
        "versions": versions,
    }
    print(json.dumps(meta, indent=1))
    results: dict[str, dict] = {}
    if "b" in sections:
        results["check"] = common.run_fresh(args.python, CASES_SCRIPT, ["check"])
        print("check:", results["check"])
        if args.tl4_python:
            results["check.tl4"] = common.run_fresh(args.tl4_python, CASES_SCRIPT, ["check.tl4"])
            print("check.tl4:", results["check.tl4"])
    has_nnsight = bool(versions.get("main", {}).get("nnsight"))
    b_configs = set(args.b_configs.split(",")) if args.b_configs else None
    for case, key, memory in plan(sections, mode, b_configs):
        python = pythons.get(key)
        if python is None:
            results[case] = {"skipped": f"no interpreter for {key} (see bench/README.md)"}
        elif "nnsight" in case and not has_nnsight:
            results[case] = {"skipped": f"nnsight is not installed in {python}"}
        else:
            start = time.perf_counter()
            result = run_process(case, python, mode, memory)
            merge(results.setdefault(case, {}), result)
            shown = {k: v for k, v in result.items() if k != "load"}
            print(
                f"{case + (' (memory)' if memory else ''):<37}{time.perf_counter() - start:>6.1f} s"
                f"  load {result['load']:.1f}  {shown}"[:250],
                flush=True,
            )
    meta["load_after"] = os.getloadavg()
    medians = summarise(results)
    ratio = ratios(medians)
    baseline = json.loads(BASELINE.read_text()) if BASELINE.exists() else {}
    print_tables(results, medians, ratio, baseline, sections)

    report = {"meta": meta, "results": results, "medians": medians, "ratios": ratio}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for path in (common.OUT_DIR / f"core-{stamp}.json", common.OUT_DIR / "core-latest.json"):
        path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwrote {common.OUT_DIR / 'core-latest.json'}")
    if args.write_baseline:
        # a partial run (--only) replaces its own sections' ratios and keeps the others
        merged = {**baseline.get("ratios", {}), **ratio}
        BASELINE.write_text(json.dumps({"meta": meta, "ratios": merged}, indent=1) + "\n")
        print(f"wrote {BASELINE}")


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
