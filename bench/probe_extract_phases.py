"""Where an extraction's wall time goes on a fast device: the disk's own write speed, the packing
(tokenizer) alone, the truncated forward alone, and `extract()` under cProfile (top functions).

    python bench/probe_extract_phases.py --device cuda --out /tmp/phases.txt     # a GPU machine
    python bench/probe_extract_phases.py --smoke                                 # tiny, on CPU

On a CPU the forward dominates and extraction runs at ~1x the forward (RESULTS.md); on an H200 the
GPT-2-small forward is ~1.6M tokens/s, so whatever else an extraction does per token shows.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu  # noqa: E402


def disk_write_mb_s(folder: Path, total: int, chunk: int = 64 * 2**20) -> float:
    """MB/s of writing `total` bytes in `chunk`s to a new file in `folder`, fsync'd at the end."""
    block = os.urandom(chunk)
    path = folder / "disk-probe.bin"
    start = time.perf_counter()
    with path.open("wb") as f:
        for _ in range(total // chunk):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return total / seconds / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--out", default=None, help="also write the report here")
    args = p.parse_args()
    import torch

    from hookscope.extract import ExtractConfig, extract
    from hookscope.sources import batches, pack
    from hookscope.testing import train_tokenizer

    if args.smoke:
        args.device, args.batch, args.seq, args.batches = "cpu", 2, 32, 4
    shape = bench_gpu.SMOKE["gpt2-tiny"] if args.smoke else bench_gpu.SHAPES["gpt2-small"]
    lines: list[str] = []
    say = lambda text: (lines.append(text), print(text, flush=True))  # noqa: E731
    work = Path(tempfile.mkdtemp(prefix="hookscope-phases-"))
    say(f"disk write (fsync'd) in {work}: {disk_write_mb_s(work, 2**28 if args.smoke else 2**30):,.0f} MB/s")
    model, layer = bench_gpu.build(shape, args.device, torch.float32 if args.smoke else torch.bfloat16)
    model.save_pretrained(work / "model")
    tokenizer = train_tokenizer(min(model.config.vocab_size, 4096))
    tokenizer.save_pretrained(work / "model")
    words = "the residual stream of a transformer carries features between layers".split()
    g = torch.Generator().manual_seed(0)
    with (work / "corpus.jsonl").open("w") as f:
        for _ in range(args.batch * args.batches + 8):
            idx = torch.randint(0, len(words), (args.seq * 2,), generator=g).tolist()
            f.write('{"text": "' + " ".join(words[i] for i in idx) + '"}\n')
    tokens = args.batch * args.seq * args.batches
    start = time.perf_counter()
    packed = list(
        batches(
            pack(bench_gpu._jsonl(work / "corpus.jsonl"), tokenizer, context=args.seq, max_tokens=tokens),
            args.batch,
        )
    )
    pack_s = time.perf_counter() - start
    floor = bench_gpu.truncated(model, layer)
    bench_gpu.sync(args.device)
    start = time.perf_counter()
    with torch.inference_mode():
        for b in packed:
            on_device = {k: b[k].to(args.device) for k in ("input_ids", "attention_mask")}
            floor(**on_device, use_cache=False)
    bench_gpu.sync(args.device)
    forward_s = time.perf_counter() - start
    point = f"blocks.{layer}.resid_post"
    cfg = ExtractConfig(
        out=str(work / "store"),
        model=str(work / "model"),
        points=[point],
        data=str(work / "corpus.jsonl"),
        context=args.seq,
        batch_size=args.batch,
        dtype="bfloat16",
        device=args.device,
        max_tokens=tokens,
        progress=False,
    )
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    summary = extract(cfg)
    profiler.disable()
    extract_s = time.perf_counter() - start
    say(
        f"{tokens:,} tokens ({args.batches} batches of {args.batch} x {args.seq}) on {args.device}: "
        f"packing alone {tokens / pack_s:,.0f} tok/s, truncated forward {tokens / forward_s:,.0f} tok/s, "
        f"extract (under cProfile) {summary.rows / extract_s:,.0f} tok/s = {extract_s:.2f} s"
    )
    for order in ("cumulative", "tottime"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(28)
        say(f"--- extract, by {order}\n" + text.getvalue().split("\n", 6)[-1])
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
