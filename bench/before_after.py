"""Issue 15's before / after: the same benchmark cases on two source trees, side by side.

    .venv/bin/python bench/before_after.py                   # before = d1912b2, after = this checkout
    .venv/bin/python bench/before_after.py --before REV --after REV_OR_DIR --rounds 2
    .venv/bin/python bench/before_after.py --before REV --rounds 4 --only small   # the per-call figure

Runs, for each tree, in fresh processes whose `PYTHONPATH` puts that tree's `src/` first (each
child reports the hookscope file it imported, and the driver refuses a mix-up):

  a      attach + remove one hook (bare function): hookscope and raw `register_forward_hook`
  small  tiny GPT-2, 1 x 16 tokens: plain forward, one noop hook attached, `with hs.capture(...)`
         around a full forward, `hs.collect`; the four take turns in one process (rounds of 50
         calls, the order rotating), and each ratio to plain is the median over that process's
         rounds; the table gives the median over processes (and each process's figure)
  b      capture blocks.5.resid_post of the GPT-2-small shape, 8 x 128: floor vs `hs.collect`
  c      12 no-op hooks vs none, full forward 8 x 128, paired in one process
  compile  bench_compile.py's steady state (off / blocks / full taking turns in one process)

Rounds alternate the trees (before, after, then after, before, ...) so a change in the machine's
load falls on both alike. Fewer repetitions than `bench_core.py`'s full run (25 min): about 10
minutes on a quiet 2-core machine at the defaults. What to read is the within-tree ratio (hookscope
over its own reference, timed in the same round) and how it moved; absolute times drift with load.
The "before" tree is exported with `git archive` into bench/out/trees/<rev>/ (nothing is checked out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

BEFORE = "d1912b2"  # the tree before issue 15's work
CASES = [  # (case of core_cases.py, timed runs per process, seconds per timed batch)
    ("a.torch.function", 7, 0.2),
    ("a.hookscope.function", 7, 0.2),
    ("small.paired", 30, None),
    ("b.floor", 5, None),
    ("b.hookscope", 5, None),
    ("c.paired", 2, None),
]
RATIOS = [  # (what, numerator case, denominator case, target for "after")
    ("a: hookscope attach / raw torch hook", "a.hookscope.function", "a.torch.function", 2.0),
    ("small: one hook / plain (paired)", "small.paired:ratio_hook", None, None),
    ("small: with hs.capture / plain (paired)", "small.paired:ratio_capture", None, 1.05),
    ("small: hs.collect / plain (paired)", "small.paired:ratio_collect", None, None),
    ("b: hs.collect / floor, 8 x 128", "b.hookscope", "b.floor", 1.10),
    ("c: 12 hooks / none (paired)", "c.paired", None, 1.03),
]
COMPILE_ROUNDS = 3


def tree_of(spec: str, out: Path) -> Path:
    """A directory holding `src/hookscope` for a revision, or the directory given."""
    path = Path(spec)
    if (path / "src" / "hookscope").is_dir():
        return path.resolve()
    rev = subprocess.run(
        ["git", "rev-parse", "--short", spec], cwd=common.REPO_DIR, check=True, capture_output=True, text=True
    ).stdout.strip()
    tree = out / "trees" / rev
    if not (tree / "src" / "hookscope").is_dir():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "archive", rev, "src"], cwd=common.REPO_DIR, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def run_case(python: str, tree: Path, case: str, runs: int, budget: float | None) -> dict:
    args = [case, "--runs", str(runs)] + (["--budget", str(budget)] if budget else [])
    result = common.run_fresh(python, common.BENCH_DIR / "core_cases.py", args, env=common.source_env(tree))
    result["load"] = os.getloadavg()[0]
    return result


def run_compile(python: str, tree: Path, cache: Path) -> dict:
    """bench_compile.py's interleaved steady state, in a fresh process on `tree`."""
    out = common.OUT_DIR / "before-after-compile.json"
    env = {**common.source_env(tree), "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    proc = subprocess.run(
        [
            python,
            str(common.BENCH_DIR / "bench_compile.py"),
            "--interleaved",
            str(COMPILE_ROUNDS),
            "--json",
            str(out),
        ],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        cwd=common.REPO_DIR,
        timeout=1800,
    )
    if proc.returncode != 0:
        return {"error": " | ".join(proc.stderr.strip().splitlines()[-8:])}
    return json.loads(out.read_text())


def check_tree(python: str, tree: Path) -> str:
    """The hookscope file a child on `tree` imports; it must lie inside that tree."""
    found = common.run_fresh(
        python, common.BENCH_DIR / "core_cases.py", ["versions"], env=common.source_env(tree)
    )
    path = found.get("hookscope_file") or ""
    if not Path(path).resolve().is_relative_to(tree / "src"):
        raise SystemExit(f"a child on {tree} imported hookscope from {path or found}: check PYTHONPATH")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--before", default=BEFORE, help="revision or directory (default %(default)s)")
    parser.add_argument("--after", default=str(common.REPO_DIR), help="revision or directory (default: here)")
    parser.add_argument("--rounds", type=int, default=2, help="processes per case and tree (default 2)")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--skip-compile", action="store_true")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated case prefixes to run (e.g. small); "
        "the compile step runs only if 'compile' is among them",
    )
    parser.add_argument("--report", action="store_true", help="only print the tables of the last run's JSON")
    args = parser.parse_args()
    if args.report:
        saved = json.loads((common.OUT_DIR / "before-after-latest.json").read_text())
        report(saved["results"])
        report_compile(saved.get("compile", {}))
        return
    started = time.time()
    trees = {"before": tree_of(args.before, common.OUT_DIR), "after": tree_of(args.after, common.OUT_DIR)}
    for label, tree in trees.items():
        print(f"{label}: {tree} -> {check_tree(args.python, tree)}")
    prepared = common.run_fresh(
        args.python, common.BENCH_DIR / "core_cases.py", ["prepare"], env=common.source_env(trees["after"])
    )
    if "error" in prepared:
        raise SystemExit(f"could not build the benchmark models: {prepared['error']}")
    only = [p for p in args.only.split(",") if p]
    cases = [c for c in CASES if not only or any(c[0].startswith(p) for p in only)]
    skip_compile = args.skip_compile or bool(only and "compile" not in only)
    print(f"load before: {os.getloadavg()}  rounds: {args.rounds}  (bench_core.py's full run uses 4)")
    results: dict = {label: {} for label in trees}
    out = common.OUT_DIR / "before-after-latest.json"
    meta = {"trees": {k: str(v) for k, v in trees.items()}, "rounds": args.rounds}
    for rnd in range(args.rounds):
        order = ["before", "after"] if rnd % 2 == 0 else ["after", "before"]
        for case, runs, budget in cases:
            for label in order:
                start = time.perf_counter()
                r = run_case(args.python, trees[label], case, runs, budget)
                pooled = results[label].setdefault(case, {})
                for key, value in r.items():
                    if isinstance(value, list):
                        pooled.setdefault(key, []).extend(value)
                    elif key == "load":
                        pooled.setdefault("loads", []).append(value)
                    else:
                        pooled[key] = value
                print(
                    f"round {rnd} {label:<6} {case:<22} {time.perf_counter() - start:6.1f} s  load "
                    f"{r['load']:.1f}  {r.get('error', '')[:200]}",
                    flush=True,
                )
                # after every process, so that a run cut short still reports (--report)
                out.write_text(json.dumps({**meta, "results": results}, indent=1) + "\n")
    report(results)  # before the compile step, which takes minutes more
    compiled: dict = {}
    if not skip_compile:
        cache = common.OUT_DIR / "inductor-before-after"  # warm after the first process: one cache for both
        for label in ("before", "after"):
            start = time.perf_counter()
            compiled[label] = run_compile(args.python, trees[label], cache)
            print(
                f"compile {label:<6} {time.perf_counter() - start:6.1f} s  load {os.getloadavg()[0]:.1f}  "
                f"{compiled[label].get('error', '')[:300]}",
                flush=True,
            )
        report_compile(compiled)
    out.write_text(
        json.dumps({**meta, "results": results, "compile": compiled, "load_after": os.getloadavg()}, indent=1)
        + "\n"
    )
    print(f"\nwrote {out}; took {(time.time() - started) / 60:.1f} min; load now {os.getloadavg()}")


def median_of(result: dict, key: str | None = None) -> float | None:
    """us per op, ms per run, or a paired ratio, as the case reports it; `key`: that list's median."""
    if key is not None:
        return common.median(result[key]) if result.get(key) else None
    for key, scale in (("us_per_op", 1.0), ("seconds", 1e3), ("pair_ratios", 1.0)):
        if result.get(key):
            return common.median(result[key]) * scale
    return None


def value_of(results: dict, ref: str) -> float | None:
    """The median a ratio names: "case" or "case:key" (a list the case reports)."""
    case, _, key = ref.partition(":")
    return median_of(results.get(case, {}), key or None)


SMALL_ROWS = [
    ("small.paired:us_" + name, f"small.{name} (paired)") for name in ("plain", "hook", "capture", "collect")
]


def report(results: dict) -> None:
    print("\n== cases (median over the processes' runs: us per op for a / small, ms for b; load median)")
    print(f"{'case':<24}{'before':>12}{'after':>12}{'after/before':>14}")
    rows = [(case, case) for case, _, _ in CASES if case != "small.paired"] + SMALL_ROWS
    for ref, label in rows:
        b, a = (value_of(results[t], ref) for t in ("before", "after"))
        print(f"{label:<24}{fmt(b):>12}{fmt(a):>12}{fmt(a / b if a and b else None, '.3f'):>14}")
    print("\n== ratios within each tree (the figures issue 15 asks for)")
    print(f"{'ratio':<40}{'before':>9}{'after':>9}{'target':>9}")
    for what, num, den, target in RATIOS:
        cells = []
        for tree in ("before", "after"):
            n = value_of(results[tree], num)
            d = value_of(results[tree], den) if den else 1.0
            cells.append(n / d if n and d else None)
        verdict = "" if target is None or cells[1] is None else ("met" if cells[1] <= target else "MISSED")
        print(
            f"{what:<40}{fmt(cells[0], '.3f'):>9}{fmt(cells[1], '.3f'):>9}"
            f"{'<= ' + str(target) if target else '':>9}  {verdict}"
        )
    print("\n== small, paired: each process's median over its rounds (ratio to plain in the same round)")
    for tree in ("before", "after"):
        found = results[tree].get("small.paired", {})
        loads = ", ".join(f"{x:.1f}" for x in found.get("loads", []))
        print(
            f"{tree:<7}"
            + "  ".join(
                f"{name} " + " ".join(f"{x:.3f}" for x in found.get(f"ratio_{name}", []))
                for name in ("hook", "capture", "collect")
            )
            + f"  (load {loads})"
        )


def report_compile(compiled: dict) -> None:
    if compiled:
        print(
            f"\n== compile steady state, {COMPILE_ROUNDS} rounds in one process per tree (median ms; x off)"
        )
        for tree in ("before", "after"):
            r = compiled.get(tree, {})
            if "error" in r:
                print(f"{tree}: ERROR {r['error'][:300]}")
                continue
            for policy, phases in r.get("median_ms", {}).items():
                ratio = r.get("ratio_vs_off", {}).get(policy, {})
                cells = "  ".join(
                    f"{name}: {ms:.0f}" + (f" ({ratio[name]:.2f}x)" if name in ratio else "")
                    for name, ms in phases.items()
                )
                print(f"{tree:<7}{policy:<7}{cells}")
            print(
                f"{tree:<7}graph breaks {r.get('graph_breaks')}, recompiles {r.get('recompiles')}, "
                f"load {r.get('load_average_1m', 0):.1f}"
            )


def fmt(value: float | None, spec: str = ",.1f") -> str:
    return "-" if value is None else format(value, spec)


if __name__ == "__main__":
    main()
