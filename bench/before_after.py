"""Issues 15 and 47's before / after: the same benchmark cases on two source trees, side by side.

    .venv/bin/python bench/before_after.py                   # before = bc88304, after = this checkout
    .venv/bin/python bench/before_after.py --before REV --after REV_OR_DIR --rounds 2
    .venv/bin/python bench/before_after.py --before REV --rounds 4 --only small   # the per-call figure
    .venv/bin/python bench/before_after.py --before bc88304 --rounds 4 --only extract,read

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
  extract  `hookscope extract` of the bundled MiniLM, 32,768 tokens of the built-in corpus to
         float16 shards in /dev/shm, at one point (extract.one) and at four (extract.four):
         rows/s of the steady state (extract_cases.py's `minilm` case, from the end of the first
         batch to the end of the writer's close). After each round the two trees' stores are
         compared byte for byte, every file (shards, manifest.json, README.md); a store that
         differs is kept for `bench/probe_store_diff.py`
  read   shuffled reading (`store.dataset(point, batch_size=4096)`, 24 epochs, page cache warm)
         of one store, bench_read.py's 768 float16 store (262,144 rows), written once by the
         "before" tree so that both read the same bytes: rows/s (bench_read.py's `after` case)

Rounds alternate the trees (before, after, then after, before, ...) so a change in the machine's
load falls on both alike; extract and read print each round's after / before ratio, their median
and spread (the range over the rounds), and rows to paste into RESULTS.md. Fewer repetitions than
`bench_core.py`'s full run (25 min): about 10 minutes on a quiet 2-core machine at the defaults
for the capture cases. What to read is the within-tree ratio (hookscope
over its own reference, timed in the same round) and how it moved; absolute times drift with load.
The "before" tree is exported with `git archive` into bench/out/trees/<rev>/ (nothing is checked out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from bench_core import merge
from probe_store_diff import files_apart, json_differences

BEFORE = "bc88304"  # main when issue 47 was filed (the commit before the formatter, 4b14ea1)
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
EXTRACT_POINTS = {  # case -> --points; every point of the four-point set has its own hooks and layout
    "extract.one": "blocks.1.resid_post",
    "extract.four": "blocks.1.resid_post,blocks.3.attn.out,blocks.3.mlp.post,blocks.5.resid_post",
}
EXTRACT_TOKENS, EXTRACT_SHARD_ROWS = 32_768, 8_192
READ_CASE, READ_D, READ_DTYPE, READ_EPOCHS = "read.shuffled", 768, "float16", 24
STORE_CASES = [*EXTRACT_POINTS, READ_CASE]
SCRATCH = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


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


def run_extract(python: str, tree: Path, case: str, store: Path) -> dict:
    """`hookscope extract` on `tree` into `store`, which is kept for the byte comparison: rows/s of
    the steady state (NaN when the process failed, so that the rounds stay aligned)."""
    shutil.rmtree(store, ignore_errors=True)
    args = ["minilm", "--points", EXTRACT_POINTS[case], "--tokens", str(EXTRACT_TOKENS)]
    args += ["--shard-rows", str(EXTRACT_SHARD_ROWS), "--out", str(store), "--keep"]
    found = common.run_fresh(python, common.BENCH_DIR / "extract_cases.py", args, env=common.source_env(tree))
    rate = found["steady_tokens"] / found["steady_s"] if "error" not in found else math.nan
    return {
        "rows_per_s": [rate],
        "load": os.getloadavg()[0],
        **({"error": found["error"]} if "error" in found else {}),
    }


def build_read_store(python: str, tree: Path) -> Path:
    """bench_read.py's 768 float16 store, written (once) by `tree`: a store both trees can read."""
    built = common.run_fresh(
        python,
        common.BENCH_DIR / "bench_read.py",
        ["--one", "build", str(READ_D), READ_DTYPE],
        env=common.source_env(tree),
    )
    if "error" in built:
        raise SystemExit(f"could not write the reading case's store: {built['error']}")
    return Path(built["path"])


def run_read(python: str, tree: Path, store: Path) -> dict:
    """Shuffled reading of `store` by `tree`'s hookscope, page cache warm (bench_read.py's measure)."""
    args = ["--one", "read", "after", str(READ_D), READ_DTYPE, "warm", str(store), "point", str(READ_EPOCHS)]
    found = common.run_fresh(
        python, common.BENCH_DIR / "bench_read.py", [*args, "0", "wall"], env=common.source_env(tree)
    )
    if "error" not in found and not Path(found["hookscope"]).resolve().is_relative_to(tree / "src"):
        found = {"error": f"the reading child imported hookscope from {found['hookscope']}"}
    rate = found.get("rows_per_s", math.nan)
    return {
        "rows_per_s": [rate],
        "load": os.getloadavg()[0],
        **({"error": found["error"]} if "error" in found else {}),
    }


def compare_round(stores: dict[str, Path]) -> dict:
    """The two trees' stores of one extraction case, byte for byte: every file, and for a file that
    differs (manifest.json: the fields that differ). Identical stores are removed, others kept."""
    names, differing = files_apart(stores["before"], stores["after"])
    found: dict = {"files": len(names), "differing": []}
    for rel in differing:
        x, y = (stores[t] / rel for t in ("before", "after"))
        fields = []
        if rel.suffix == ".json" and x.is_file() and y.is_file():
            fields = json_differences(json.loads(x.read_bytes()), json.loads(y.read_bytes()))
        found["differing"].append(f"{rel}" + (f" ({', '.join(fields)})" if fields else ""))
    if found["differing"] or not names:
        found["kept"] = {t: str(path) for t, path in stores.items()}
    else:
        for path in stores.values():
            shutil.rmtree(path)
    return found


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
        if any(case not in STORE_CASES for case in saved["results"]["before"]):
            report(saved["results"])
        report_stores(saved["results"], saved.get("bytes", {}), saved)
        report_compile(saved.get("compile", {}))
        return
    started = time.time()
    trees = {"before": tree_of(args.before, common.OUT_DIR), "after": tree_of(args.after, common.OUT_DIR)}
    for label, tree in trees.items():
        print(f"{label}: {tree} -> {check_tree(args.python, tree)}")
    only = [p for p in args.only.split(",") if p]
    cases = [
        c
        for c in CASES + [(c, 1, None) for c in STORE_CASES]
        if not only or any(c[0].startswith(p) for p in only)
    ]
    core = [c for c in cases if c[0] not in STORE_CASES]
    if core:
        prepared = common.run_fresh(
            args.python,
            common.BENCH_DIR / "core_cases.py",
            ["prepare"],
            env=common.source_env(trees["after"]),
        )
        if "error" in prepared:
            raise SystemExit(f"could not build the benchmark models: {prepared['error']}")
    read_store = (
        build_read_store(args.python, trees["before"]) if any(c[0] == READ_CASE for c in cases) else None
    )
    skip_compile = args.skip_compile or bool(only and "compile" not in only)
    print(f"load before: {os.getloadavg()}  rounds: {args.rounds}  (bench_core.py's full run uses 4)")
    out = common.OUT_DIR / "before-after-latest.json"
    meta = {"trees": {k: str(v) for k, v in trees.items()}, "rounds": args.rounds, "only": args.only}
    meta["started"] = time.time()
    results, compared = run_rounds(args, trees, cases, read_store, lambda saved: write_json(out, meta, saved))
    meta["ended"] = time.time()
    if core:
        report(results)  # before the compile step, which takes minutes more
    report_stores(results, compared, meta)
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
    write_json(
        out, meta, {"results": results, "bytes": compared, "compile": compiled, "load_after": os.getloadavg()}
    )
    print(f"\nwrote {out}; took {(time.time() - started) / 60:.1f} min; load now {os.getloadavg()}")


def run_rounds(args: argparse.Namespace, trees: dict, cases: list, read_store: Path | None, save) -> tuple:
    """Every case in every round, each tree in a fresh process, the trees' order alternating; the
    extraction cases' stores compared after each round. Saved after every process (`save`), so
    that a run cut short still reports (--report)."""
    results: dict = {label: {} for label in trees}
    compared: dict = {}
    scratch = SCRATCH / f"hookscope-before-after-{os.getpid()}"
    for rnd in range(args.rounds):
        order = ["before", "after"] if rnd % 2 == 0 else ["after", "before"]
        for case, runs, budget in cases:
            stores = {label: scratch / f"{label}-{case}" for label in order}
            for label in order:
                start = time.perf_counter()
                if case in EXTRACT_POINTS:
                    r = run_extract(args.python, trees[label], case, stores[label])
                elif case == READ_CASE:
                    r = run_read(args.python, trees[label], read_store)
                else:
                    r = run_case(args.python, trees[label], case, runs, budget)
                merge(results[label].setdefault(case, {}), r)
                print(
                    f"round {rnd} {label:<6} {case:<22} {time.perf_counter() - start:6.1f} s  load "
                    f"{r['load']:.1f}  {r.get('error', '')[:200]}",
                    flush=True,
                )
                save({"results": results, "bytes": compared})
            if case in EXTRACT_POINTS:
                compared.setdefault(case, []).append(compare_round(stores))
                print(f"round {rnd} bytes  {case:<22} {describe(compared[case][-1])}", flush=True)
                save({"results": results, "bytes": compared})
    if scratch.is_dir() and not any(scratch.iterdir()):  # every pair was identical, and removed
        scratch.rmdir()
    return results, compared


def write_json(out: Path, meta: dict, saved: dict) -> None:
    out.write_text(json.dumps({**meta, **saved}, indent=1) + "\n")


def describe(comparison: dict) -> str:
    if not comparison["files"]:
        return "no store to compare (a process failed)"
    if not comparison["differing"]:
        return f"byte-identical ({comparison['files']} files)"
    kept = ", ".join(comparison["kept"].values())
    return f"DIFFER: {'; '.join(comparison['differing'])} (kept: {kept}; bench/probe_store_diff.py A B)"


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


STORE_MEASURES = {  # case -> what RESULTS.md's row measures
    "extract.one": f"extraction, bundled MiniLM `{EXTRACT_POINTS['extract.one']}`",
    "extract.four": f"extraction, bundled MiniLM, 4 points (`{EXTRACT_POINTS['extract.four']}`)",
    READ_CASE: f"shuffled reading, {READ_D} {READ_DTYPE}, 262,144 rows, {READ_EPOCHS} epochs, warm",
}
HISTORY_ENTRY = (
    "Twentieth session: the house (issue 47), before / after: extraction, reading, the stores' bytes"
)


def store_verdict(ratios: list[float]) -> str:
    """A regression outside the rounds' spread: every round's after / before below 1."""
    if len(ratios) < 2:
        return "one round: no spread to judge by"
    if max(ratios) < 1:
        return f"REGRESSION: after slower in every round (at best {max(ratios):.3f})"
    return "no regression outside the spread"


def store_rows(results: dict, compared: dict, case: str) -> dict | None:
    """One case's figures: each tree's rows/s per round, the per-round ratios, median and spread."""
    before, after = (results[t].get(case, {}).get("rows_per_s", []) for t in ("before", "after"))
    if not before or not after:
        return None
    ratios = [a / b for a, b in zip(after, before, strict=False) if not (math.isnan(a) or math.isnan(b))]
    checks = compared.get(case, [])
    loads = results["before"][case].get("loads", []) + results["after"][case].get("loads", [])
    return {
        "before": before,
        "after": after,
        "ratios": ratios,
        "identical": sum(bool(c["files"]) and not c["differing"] for c in checks),
        "checked": len(checks),
        "loads": loads,
    }


def report_stores(results: dict, compared: dict, meta: dict) -> None:
    rows = {case: store_rows(results, compared, case) for case in STORE_CASES}
    rows = {case: row for case, row in rows.items() if row}
    if not rows:
        return
    print("\n== extraction and reading: rows/s per round (before | after), after / before in the same round")
    for case, row in rows.items():
        ratios = row["ratios"]
        spread = f"{min(ratios):.3f}-{max(ratios):.3f}" if ratios else "-"
        middle = fmt(common.median(ratios) if ratios else None, ".3f")
        print(
            f"{case:<14} before {' '.join(fmt(x, ',.0f') for x in row['before'])} | after "
            f"{' '.join(fmt(x, ',.0f') for x in row['after'])}\n{'':<14} ratios "
            f"{' '.join(f'{x:.3f}' for x in ratios)}; median {middle}, spread {spread}: "
            f"{store_verdict(ratios)}"
        )
        if case in compared:
            print(f"{'':<14} stores byte-identical in {row['identical']} of {row['checked']} rounds")
            for rnd, check in enumerate(compared[case]):
                if check["differing"] or not check["files"]:
                    print(f"{'':<14} round {rnd}: {describe(check)}")
    print_results_rows(rows, meta)


def print_results_rows(rows: dict, meta: dict) -> None:
    """The rows for bench/RESULTS.md's table, as they stand."""
    before = Path(meta["trees"]["before"]).name
    when = " - ".join(
        time.strftime("%Y-%m-%d %H:%M", time.gmtime(meta[k])) for k in ("started", "ended") if k in meta
    )
    only = f" --only {meta['only']}" if meta.get("only") else ""
    command = f"`before_after.py --before {before} --rounds {meta['rounds']}{only}`"
    print(
        "\n== for bench/RESULTS.md (rows/s: medians over the rounds; load: the 1-minute load at each process)"
    )
    for case, row in rows.items():
        after, prior = (
            common.median([x for x in row[t] if not math.isnan(x)] or [math.nan]) for t in ("after", "before")
        )
        ratios = row["ratios"]
        ratio = (
            f"{common.median(ratios):.3f} after / before (rounds {min(ratios):.3f}-{max(ratios):.3f}: "
            f"{store_verdict(ratios)})"
            if ratios
            else "-"
        )
        if case in EXTRACT_POINTS:
            size = f", {EXTRACT_TOKENS:,} tokens to float16 in {SCRATCH}"
            ratio += f"; stores byte-identical in {row['identical']} of {row['checked']} rounds"
        else:
            size = ""
        loads = row["loads"]
        quiet = "quiet" if max(loads) <= common.THREADS else "**loaded**"
        print(
            f"| {STORE_MEASURES[case]}{size} ({command}) | {after:,.0f} rows/s | {before} in the same "
            f"rounds: {prior:,.0f} rows/s | {ratio} | {when} | {quiet} ({min(loads):.1f}-{max(loads):.1f}) | "
            f"{HISTORY_ENTRY} |"
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
