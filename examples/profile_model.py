"""Profile a model before and after a dtype change: where the time goes, block by block.

`hs.profile` (the `hookscope profile` command is the same) times a few steps, then runs
torch.profiler with a `record_function` label on every block and writes a table, a Chrome /
Perfetto trace, a bar chart and an HTML page. Here: profile in float32, cast the model to
bfloat16 (or --dtype), profile again, and draw the two side by side. On the command line:

    hookscope profile MODEL --out prof/float32
    hookscope profile MODEL --dtype bfloat16 --out prof/bfloat16

    python examples/profile_model.py [--model PATH] [--dtype bfloat16] [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from matplotlib.figure import Figure

import hookscope as hs
from hookscope.profiling import random_tokens


def block_ms(report: hs.ProfileReport) -> dict[str, float]:
    return {row.name: row.total_s * 1e3 for row in report.rows if row.kind == "block"}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="Hugging Face id or directory (default: the bundled MiniLM)")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["float16", "bfloat16"],
        help="the dtype to compare float32 with",
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="out/profile_model")
    args = p.parse_args(argv)
    out = Path(args.out)

    model = hs.load(args.model).model
    inputs = random_tokens(model, args.batch, args.seq)  # the time a pass takes does not depend on the text

    reports = {}
    for dtype in ("float32", args.dtype):
        model.to(getattr(torch, dtype))
        reports[dtype] = hs.profile(model, inputs, steps=args.steps, warmup=args.warmup, out_dir=out / dtype)
        header_and_blocks = reports[dtype].summary().split("\n\n")[:2]
        print("\n\n".join(header_and_blocks) + "\n")

    before, after = (block_ms(r) for r in reports.values())
    print(f"{'block':10s} {'float32 ms':>11s} {args.dtype + ' ms':>12s}  ratio")
    for name in before:
        print(f"{name:10s} {before[name]:11.2f} {after[name]:12.2f}  {after[name] / before[name]:5.2f}x")
    step = {dtype: r.step_time_s * 1e3 for dtype, r in reports.items()}
    print(f"step (no profiler): float32 {step['float32']:.1f} ms, {args.dtype} {step[args.dtype]:.1f} ms")

    fig = Figure(figsize=(7, 1.5 + 0.45 * len(before)), layout="constrained")
    ax = fig.add_subplot()
    y = torch.arange(len(before), dtype=torch.float32)
    ax.barh(
        y - 0.2,
        list(before.values()),
        height=0.4,
        color="#4C72B0",
        label=f"float32 (step {step['float32']:.1f} ms)",
    )
    ax.barh(
        y + 0.2,
        list(after.values()),
        height=0.4,
        color="#DD8452",
        label=f"{args.dtype} (step {step[args.dtype]:.1f} ms)",
    )
    ax.set_yticks(y, list(before))
    ax.invert_yaxis()
    ax.set_xlabel("ms per forward pass, under the profiler")
    fig.legend(fontsize=8, loc="outside lower center", ncol=2)
    ax.set_title(
        f"Time per block, {args.batch}x{args.seq} tokens on {reports['float32'].device} "
        f"({Path(args.model or 'all-MiniLM-L6-v2').name})",
        fontsize=10,
    )
    fig.savefig(out / "dtype_comparison.png", dpi=100)
    print(
        f"picture: {out / 'dtype_comparison.png'}; each profile's table, trace, PNG and HTML in "
        f"{out / 'float32'} and {out / args.dtype}"
    )
    return {
        "reports": reports,
        "block_ms": {"float32": before, args.dtype: after},
        "step_ms": step,
        "picture": out / "dtype_comparison.png",
    }


if __name__ == "__main__":
    main()
