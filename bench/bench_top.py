"""Benchmark of the top-k index (issue 21): building it for every unit of a d_model 768 point over
1M rows, against the shuffled-reading floor of the same store; peak memory; one query's time.

    .venv/bin/python bench/bench_top.py            # 1,048,576 rows x 768 float16 (1.5 GiB on disk), 3 rounds
    .venv/bin/python bench/bench_top.py --rows 131072 --rounds 1   # smoke run

The store is synthetic (a 1M-token GPT-2-small forward does not fit this machine's time budget):
written once with the real ShardWriter into bench/out/top-store-<rows>/ (float16, shards of 65,536
rows, token_ids / doc_ids / positions / seq_ids as hookscope extract writes them), values
N(0, 1) with a ReLU on half the units (sparse units tie at 0, the index's slow path).

Every measurement runs in a fresh process (2 threads), rounds interleaved, page cache warm (one
untimed sequential read first):
- floor: `store.dataset(point, shuffle=True, batch_size=4096)` read to the end, each batch summed
  (what a training loop over the store pays, the issue's "shuffled-reading floor")
- build: `build_index(store, point, k=32)` for all 768 units + `save`; rows/s and peak memory
  (anonymous RSS sampled every 20 ms: the mapped shard pages are the page cache's, not ours;
  VmHWM is printed too)
- query: `open_store` + `top(store, point, unit, k=20, context=8, tokenizer=...)` from the saved
  index, median over 20 units (the tokenizer is loaded before the clock starts)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
OUT = BENCH_DIR / "out"
POINT = "blocks.6.resid_post"
D = 768
SHARD_ROWS = 65536
SEQ = 128


def store_dir(rows: int) -> Path:
    return OUT / f"top-store-{rows}"


def tokenizer_dir() -> Path:
    return OUT / "top-tokenizer"


def make_store(rows: int) -> Path:
    import torch

    from hookscope.store import ShardWriter
    from hookscope.testing import train_tokenizer

    path = store_dir(rows)
    if (path / "ready").exists():
        return path
    tok_dir = tokenizer_dir()
    if not (tok_dir / "tokenizer.json").exists():
        train_tokenizer().save_pretrained(tok_dir)
    vocab = 512
    settings = {
        "model": None,
        "points": [POINT],
        "dtype": "float16",
        "context": SEQ,
        "bench": "top",
        "rows": rows,
    }
    gen = torch.Generator().manual_seed(0)
    batch = 8192
    with ShardWriter(path, settings, shard_rows=SHARD_ROWS) as w:
        for b in range(rows // batch):
            x = torch.randn(batch, D, generator=gen)
            x[:, : D // 2].clamp_(min=0)  # half the units ReLU-like: sparse, many ties at 0
            start = b * batch
            r = torch.arange(start, start + batch)
            meta = {
                "token_ids": torch.randint(0, vocab, (batch,), generator=gen),
                "doc_ids": r // 300,
                "positions": r % 300,
                "seq_ids": r // SEQ,
            }
            w.write(b, {POINT: x.half()}, meta)
            print(f"\rwriting the store: {start + batch:,} / {rows:,} rows", end="", file=sys.stderr)
    print(file=sys.stderr)
    (path / "ready").write_text("ok\n")
    return path


class AnonPeak:
    """Peak anonymous RSS (RssAnon), sampled in a thread."""

    def __init__(self, every: float = 0.02):
        self.every, self.peak, self._stop = every, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(self.every)

    def __enter__(self):
        self.base = self.now()
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.now())


def vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def cpu_seconds() -> float:
    """User + system CPU time of this process: less at the mercy of other processes than the clock."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child(mode: str, rows: int) -> dict:
    import torch

    torch.set_num_threads(2)
    from hookscope.store import open_store
    from hookscope.top import build_index, index_path, neurons, top

    path = store_dir(rows)
    store = open_store(path)
    cpu0 = cpu_seconds()
    if mode == "floor":
        ds = store.dataset(POINT, shuffle=True, batch_size=4096, seed=0)
        total = 0.0
        n = 0
        with AnonPeak() as mem:
            t0 = time.perf_counter()
            for batch in ds:
                total += float(batch.float().sum())
                n += batch.shape[0]
                if n >= len(store):
                    break
            dt = time.perf_counter() - t0
        return {
            "mode": mode,
            "rows": n,
            "seconds": dt,
            "rows_per_s": n / dt,
            "anon_peak": mem.peak,
            "anon_base": mem.base,
            "vm_hwm": vm_hwm(),
            "cpu_s": cpu_seconds() - cpu0,
        }
    if mode == "build":
        with AnonPeak() as mem:
            t0 = time.perf_counter()
            index = build_index(store, POINT, k=32)
            index.save(index_path(store, POINT, neurons(D)))
            dt = time.perf_counter() - t0
        return {
            "mode": mode,
            "rows": len(store),
            "seconds": dt,
            "rows_per_s": len(store) / dt,
            "anon_peak": mem.peak,
            "anon_base": mem.base,
            "vm_hwm": vm_hwm(),
            "cpu_s": cpu_seconds() - cpu0,
        }
    if mode == "query":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir())
        times = []
        for unit in range(0, D, D // 20)[:20]:
            t0 = time.perf_counter()
            result = top(open_store(path), POINT, unit, k=20, context=8, tokenizer=tok)
            times.append(time.perf_counter() - t0)
            assert len(result.contexts) == 20
        return {"mode": mode, "times": times, "median_s": statistics.median(times)}
    if mode == "warm":
        for i in range(store.num_shards):
            store.load_shard(i, [POINT])[POINT].float().sum()
        return {"mode": mode}
    raise SystemExit(f"unknown mode {mode}")


def run_child(mode: str, rows: int) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    out = subprocess.run(
        [sys.executable, __file__, "--child", mode, "--rows", str(rows)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=1 << 20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", default=None)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.rows)))
        return
    make_store(args.rows)
    print(f"load before: {open('/proc/loadavg').read().strip()}")
    run_child("warm", args.rows)
    floors, builds = [], []
    for r in range(args.rounds):
        f = run_child("floor", args.rows)
        b = run_child("build", args.rows)
        floors.append(f)
        builds.append(b)
        print(
            f"round {r + 1}: floor {f['rows_per_s']:,.0f} rows/s ({f['seconds']:.1f} s), build "
            f"{b['rows_per_s']:,.0f} rows/s ({b['seconds']:.1f} s), "
            f"ratio {b['rows_per_s'] / f['rows_per_s']:.2f}; "
            f"CPU s floor {f['cpu_s']:.1f}, build {b['cpu_s']:.1f}; "
            f"anon peak floor {f['anon_peak'] / 2**20:.0f} MiB, build {b['anon_peak'] / 2**20:.0f} MiB "
            f"(VmHWM {b['vm_hwm'] / 2**20:.0f} MiB); load {open('/proc/loadavg').read().split()[0]}"
        )
    q = run_child("query", args.rows)
    fl = statistics.median(x["rows_per_s"] for x in floors)
    bl = statistics.median(x["rows_per_s"] for x in builds)
    ratios = [b["rows_per_s"] / f["rows_per_s"] for f, b in zip(floors, builds, strict=True)]
    print(f"\n{args.rows:,} rows x {D} float16, {args.rounds} rounds (median):")
    print(f"  shuffled-reading floor  {fl:,.0f} rows/s")
    print(
        f"  build index (k=32, all {D} units) {bl:,.0f} rows/s  = {bl / fl:.2f}x the floor "
        f"(per-round ratios {', '.join(f'{r:.2f}' for r in ratios)}; target >= 0.8)"
    )
    print(
        f"  CPU seconds (user + system): floor {statistics.median(x['cpu_s'] for x in floors):.1f}, build "
        f"{statistics.median(x['cpu_s'] for x in builds):.1f}"
    )
    print(
        f"  peak anonymous RSS: build {statistics.median(x['anon_peak'] for x in builds) / 2**20:.0f} MiB, "
        f"floor {statistics.median(x['anon_peak'] for x in floors) / 2**20:.0f} MiB"
    )
    print(
        f"  one query from the saved index (open_store + top, k=20, context 8): median "
        f"{q['median_s'] * 1000:.1f} ms (min {min(q['times']) * 1000:.1f}, "
        f"max {max(q['times']) * 1000:.1f})"
    )
    print(f"load after: {open('/proc/loadavg').read().strip()}")


if __name__ == "__main__":
    main()
