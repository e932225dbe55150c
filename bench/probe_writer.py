"""The store writer thread's work per batch, on the CPU: `PointStats.of` alone, and a whole
`ShardWriter` (stats, concatenation, safetensors, SHA-256, fsync, rename, manifest) fed batches
that are already on the CPU, so that the caller never waits on anything but the writer.

    python bench/probe_writer.py                      # 32768 x 768 bf16 batches, 5 fresh processes
    python bench/probe_writer.py --smoke              # tiny

Each run is a fresh process (nothing warm from the run before); the figures are medians over runs.
Compare two trees by pointing PYTHONPATH at each one's src/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one_run(args: argparse.Namespace) -> dict[str, float]:
    """Seconds per batch in this process: the stats alone (median over batches), the whole writer."""
    import torch

    from hookscope.store import PointStats
    from hookscope.store.writer import ShardWriter

    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randn(args.rows, args.width, generator=g).to(torch.bfloat16) for _ in range(args.batches)
    ]
    meta = {"token_ids": torch.arange(args.rows)}
    stats_s = []
    for b in batches:
        start = time.perf_counter()
        PointStats.of(b)
        stats_s.append(time.perf_counter() - start)
    with tempfile.TemporaryDirectory(prefix="hookscope-writer-probe-") as tmp:
        start = time.perf_counter()
        with ShardWriter(Path(tmp) / "store", {"probe": 1}, shard_rows=args.shard_rows) as writer:
            for i, b in enumerate(batches):
                writer.write(i, {"blocks.6.resid_post": b}, meta)
        writer_s = (time.perf_counter() - start) / args.batches
    return {"stats_s": statistics.median(stats_s), "writer_s": writer_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=32768)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--shard-rows", type=int, default=65536)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.rows, args.width, args.batches, args.shard_rows, args.runs = 64, 16, 4, 128, 1
    if args.child:
        print(json.dumps(one_run(args)))
        return
    forwarded = [a for a in sys.argv[1:] if a != "--smoke"]
    if args.smoke:
        forwarded += ["--rows", "64", "--width", "16", "--batches", "4", "--shard-rows", "128"]
    runs = [
        json.loads(
            subprocess.run(
                [sys.executable, __file__, "--child", *forwarded], check=True, capture_output=True, text=True
            ).stdout
        )
        for _ in range(args.runs)
    ]
    stats_ms = statistics.median(r["stats_s"] for r in runs) * 1e3
    writer_ms = statistics.median(r["writer_s"] for r in runs) * 1e3
    print(
        f"{args.batches} batches of {args.rows} x {args.width} bf16, shards of {args.shard_rows} rows, "
        f"median of {args.runs} fresh processes: PointStats.of {stats_ms:.1f} ms/batch, "
        f"whole writer {writer_ms:.1f} ms/batch ({args.rows / writer_ms * 1e3:,.0f} rows/s)"
    )


if __name__ == "__main__":
    main()
