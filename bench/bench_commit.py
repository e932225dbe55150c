"""The store's bookkeeping at scale (issue 34 item 3): what a shard commit costs as the store grows,
and how long a store of 100,000 shards takes to open, verify and resume.

    PYTHONPATH=src .venv/bin/python bench/bench_commit.py                 # both parts, ~3 min loaded
    PYTHONPATH=src .venv/bin/python bench/bench_commit.py --shards 3000 --big 0   # commits only

Commits: one `ShardWriter` (shard_rows = the batch's rows, so every batch is one shard) is fed
`--shards` tiny batches (4 rows of 8 float32 and a `token_ids` column); the time of each shard's
`_put_and_commit` (fsync, rename, commit; `_write_shard` before the writer had a commit thread:
save, hash, fsync, rename, commit) is recorded, and the median per tenth of the run
is printed with its ratio to the first tenth. The floor beside it: the same shard files written and
fsynced by hand (safetensors save + fsync + rename), no manifest at all.

Scale: a store of `--big` tiny shards (one batch of 4 rows each) is made directly (safetensors files
with their identity, then the manifest, as the writer would leave them); then, each in `--runs` fresh
processes, `open_store` (list + parse + check), `open_store(verify=True)` (every SHA-256 and header),
and a resume (`ShardWriter` opening the finished store, and closing it with nothing written). Medians.
The store lives in --dir (default a temporary directory under /dev/shm: memory-backed, so the figures
are the bookkeeping's, not a disk's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

SETTINGS = {"bench": "commit"}
ROWS, WIDTH = 4, 8


def batch(i: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(i)
    return {"x": torch.randn(ROWS, WIDTH, generator=g)}, {"token_ids": torch.arange(i * ROWS, (i + 1) * ROWS)}


def commits(root: Path, shards: int) -> dict:
    from hookscope.store import ShardWriter
    from hookscope.store import writer as writer_module

    times: list[float] = []
    # a shard's fsync, rename and commit (on the writer's commit thread, where it has one)
    step = "_put_and_commit" if hasattr(writer_module.ShardWriter, "_put_and_commit") else "_write_shard"
    real = getattr(writer_module.ShardWriter, step)

    def timed(self, *args):
        t = time.perf_counter()
        real(self, *args)
        times.append(time.perf_counter() - t)

    setattr(writer_module.ShardWriter, step, timed)
    out = root / "commits"
    t0 = time.perf_counter()
    with ShardWriter(out, SETTINGS, shard_rows=ROWS) as w:
        for i in range(shards):
            x, meta = batch(i)
            w.write(i, x, meta)
    total = time.perf_counter() - t0
    setattr(writer_module.ShardWriter, step, real)
    tenth = shards // 10
    medians = [statistics.median(times[k * tenth : (k + 1) * tenth]) * 1e3 for k in range(10)]
    means = [statistics.mean(times[k * tenth : (k + 1) * tenth]) * 1e3 for k in range(10)]
    floor = _floor(root / "floor", min(shards, 300))
    return {
        "shards": shards,
        "seconds": total,
        "ms_per_tenth": [round(m, 3) for m in medians],
        "last_over_first": round(medians[-1] / medians[0], 2),
        "mean_ms_per_tenth": [round(m, 3) for m in means],
        "max_ms": round(max(times) * 1e3, 1),
        "floor_ms": round(floor, 3),
        "manifest_bytes": (out / "manifest.json").stat().st_size,
    }


def _floor(root: Path, n: int) -> float:
    """Median ms to save, fsync and rename one such shard, with no bookkeeping."""
    root.mkdir(parents=True)
    times = []
    for i in range(n):
        x, meta = batch(i)
        t = time.perf_counter()
        tmp = root / f"{i}.tmp"
        save_file({**x, **meta}, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, root / f"{i}.safetensors")
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def make_big(out: Path, n: int) -> None:
    """A finished store of `n` one-batch shards, as the writer leaves it (made directly: fast)."""
    import hashlib

    from hookscope.store.manifest import Column, Manifest, ShardEntry, shard_identity, shard_prefix
    from hookscope.store.stats import PointStats

    (out / "shards").mkdir(parents=True)
    m = Manifest(settings=SETTINGS)
    shards, prefix = [], shard_prefix(0)
    for i in range(n):
        x, meta = batch(i)
        runs = ((i, i, 1),)
        name = f"shards/{prefix}{i:06d}.safetensors"
        save_file({**x, **meta}, out / name, metadata=shard_identity(m.settings_hash, runs, 0))
        data = (out / name).read_bytes()
        shards.append(
            ShardEntry(
                name,
                ROWS,
                hashlib.sha256(data).hexdigest(),
                len(data),
                runs,
                0,
                0,
                {"x": PointStats.of(x["x"])},
            )
        )
    from hookscope.store.manifest import summed_stats

    m = Manifest(
        settings=SETTINGS,
        points={"x": Column((WIDTH,), "float32")},
        meta={"token_ids": Column((), "int64")},
        shards=shards,
        stats=summed_stats(shards),
    )
    (out / "manifest.json").write_bytes(m.to_bytes())


STEP = """
import sys, time
from hookscope.store import ShardWriter, open_store
what, out = sys.argv[1], sys.argv[2]
t = time.perf_counter()
if what == "open":
    s = open_store(out)
elif what == "verify":
    s = open_store(out, verify=True)
else:
    w = ShardWriter(out, {"bench": "commit"}, shard_rows=4)
    w.close()
print(time.perf_counter() - t)
"""


def scale(root: Path, n: int, runs: int) -> dict:
    out = root / "big"
    t = time.perf_counter()
    make_big(out, n)
    made = time.perf_counter() - t
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = {
        "shards": n,
        "made_s": round(made, 1),
        "manifest_mb": round((out / "manifest.json").stat().st_size / 1e6, 1),
    }
    for what in ("open", "verify", "resume"):
        secs = []
        for _ in range(runs):
            done = subprocess.run(
                [sys.executable, "-c", STEP, what, str(out)],
                env=env,
                capture_output=True,
                text=True,
                timeout=1800,
            )
            if done.returncode:
                raise SystemExit(done.stderr[-3000:])
            secs.append(float(done.stdout.split()[-1]))
        result[f"{what}_s"] = round(statistics.median(secs), 2)
        result[f"{what}_all"] = [round(s, 2) for s in secs]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=3000)
    ap.add_argument("--big", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"load: {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-commit-") as tmp:
        root = Path(tmp)
        if args.shards:
            print(json.dumps({"commits": commits(root, args.shards)}), flush=True)
        if args.big:
            print(json.dumps({"scale": scale(root, args.big, args.runs)}), flush=True)
    print(f"load: {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
