"""Extraction of the last block of a model whose weights are not all held (issue 29, item 3):
`--max-memory` block streaming against the in-memory extraction, and against accelerate's own
disk offload (`device_map` + `max_memory` + `offload_folder`) running the same batches.

The model is bench_big.py's (Llama-shaped, 16 blocks, d_model 1024, float32 safetensors, 1.08 GB)
with a small tokenizer saved beside it. The limit: the weights outside the blocks (embeddings,
norm) + two blocks (the one computing, the one read ahead) + room for a chunk of hidden states.
Each run is a fresh process; tokens/s counts the whole `extract` call (weights read included),
peak RSS is VmHWM above the process before loading; median of --runs.

    python bench/bench_stream.py            # 3 runs per mode
    python bench/bench_stream.py --quick    # 1 run per mode
    python bench/bench_stream.py --device cuda --quick   # on a GPU (scripts/gpu-suite): the limit is
                                         # device memory; peak = the allocator's (max_memory_allocated)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_big  # noqa: E402
import common  # noqa: E402

POINT = f"blocks.{bench_big.SHAPE['num_hidden_layers'] - 1}.resid_post"
BATCH, CONTEXT, TOKENS = 4, 128, 2048  # 4 batches
MODES = ("memory", "stream", "offload")
MiB = 2**20


def ensure_model() -> Path:
    path = bench_big.ensure_big_model()
    if not (path / "tokenizer.json").exists():
        from hookscope.testing import train_tokenizer

        train_tokenizer(512).save_pretrained(path)
    return path


def outside_blocks_bytes() -> int:
    """float32 weights outside the blocks that streaming keeps: embeddings and the final norm (the
    output head is not needed before the last block)."""
    return (bench_big.SHAPE["vocab_size"] + 1) * bench_big.SHAPE["hidden_size"] * 4


def chunk_room() -> int:
    """Room for the hidden states of two batches (a block's input and output) and the kept rows."""
    return 2 * BATCH * CONTEXT * bench_big.SHAPE["hidden_size"] * (2 * 4 + 2)


def limit_bytes() -> int:
    return outside_blocks_bytes() + 2 * bench_big.block_bytes(4) + chunk_room()


def corpus(folder: str, docs: int = 60) -> str:
    import random

    rng = random.Random(common.SEED)
    words = "alpha beta gamma delta layer head token residual stream sparse feature probe".split()
    path = Path(folder) / "corpus.txt"
    path.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(200)) for _ in range(docs)))
    return str(path)


def worker(mode: str, device: str) -> None:
    common.setup_process()
    import torch

    from hookscope.extract import ExtractConfig, extract

    before = common.rss_bytes()[0] if device == "cpu" else torch.cuda.memory_allocated()
    common.reset_rss_peak()
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        if mode == "offload":
            tokens = offload_run(folder, device)
        else:
            summary = extract(
                ExtractConfig(
                    out=f"{folder}/store",
                    model=str(bench_big.BIG_DIR),
                    points=[POINT],
                    data=corpus(folder),
                    context=CONTEXT,
                    batch_size=BATCH,
                    max_tokens=TOKENS,
                    dtype="bfloat16",
                    drop_bos=False,
                    progress=False,
                    device=device,
                    max_memory=limit_bytes() if mode == "stream" else None,
                )
            )
            tokens = summary.rows
        seconds = time.perf_counter() - start
        peak = bench_big.peak_now(device)
    chunk = chunk_batches() if mode == "stream" else None
    common.emit(
        {
            "mode": mode,
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            "peak_extra": peak - before,
            "chunk_batches": chunk,
            "device": device,
        }
    )


def chunk_batches() -> int:
    import torch

    import hookscope as hs
    from hookscope.loading.stream_plan import plan_stream

    loaded = hs.load(str(bench_big.BIG_DIR), device="meta", tokenizer=False)
    return plan_stream(
        loaded.model,
        loaded.arch,
        [POINT],
        limit_bytes(),
        batch_size=BATCH,
        context=CONTEXT,
        store_itemsize=torch.bfloat16.itemsize,
    ).chunk_batches


def offload_run(folder: str, device: str) -> int:
    """accelerate's offload of the same model under the same limit, capturing the same point from
    as many batches of the same shape (token values do not change the work)."""
    import torch
    from transformers import AutoModelForCausalLM

    import hookscope as hs

    room = {"cpu": limit_bytes()} if device == "cpu" else {0: limit_bytes(), "cpu": "64GiB"}
    model = AutoModelForCausalLM.from_pretrained(
        bench_big.BIG_DIR, device_map="auto", max_memory=room, offload_folder=folder
    ).eval()
    for i in range(TOKENS // (BATCH * CONTEXT)):
        ids = common.input_ids(bench_big.SHAPE["vocab_size"], batch=BATCH, seq=CONTEXT, seed=i)
        ids = ids.to(bench_big.input_device(model))
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        hs.collect(model, inputs, POINT, dtype=torch.bfloat16)
    return TOKENS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", default=None, choices=MODES)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the limit and peak are device memory")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.device)
    ensure_model()
    runs = 1 if args.quick else args.runs
    rows = {
        mode: [
            common.run_fresh(
                args.python,
                Path(__file__),
                ["--worker", mode, "--device", args.device],
                env=common.MEMORY_ENV,
            )
            for _ in range(runs)
        ]
        for mode in MODES
    }
    report(rows)


def report(rows: dict[str, list[dict]]) -> None:
    print(
        f"\nextract {POINT}: {TOKENS} tokens, batches of {BATCH}x{CONTEXT}; "
        f"limit {limit_bytes() / MiB:.1f} MiB (outside the blocks {outside_blocks_bytes() / MiB:.1f} "
        f"+ two blocks {2 * bench_big.block_bytes(4) / MiB:.1f} + chunk room {chunk_room() / MiB:.1f})"
    )
    best: dict[str, dict] = {}
    for mode, results in rows.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            print(f"  {mode:8s} ERROR {results[0]['error']}")
            continue
        speed = common.median([r["tokens_per_s"] for r in ok])
        peak = common.median([r["peak_extra"] for r in ok])
        best[mode] = {"tokens_per_s": speed, "peak_extra": peak, "chunk_batches": ok[0]["chunk_batches"]}
        each = ", ".join(f"{r['tokens_per_s']:.1f}" for r in ok)
        kind = "RSS" if ok[0]["device"] == "cpu" else "device memory"
        print(f"  {mode:8s} {speed:8.1f} tokens/s  peak {kind} +{peak / MiB:7.1f} MiB  (runs: {each})")
    if "memory" in best and "stream" in best:
        chunk = best["stream"]["chunk_batches"] * BATCH * CONTEXT * bench_big.SHAPE["hidden_size"] * 4
        bound = limit_bytes() + chunk + 300 * MiB
        ratio = best["stream"]["tokens_per_s"] / best["memory"]["tokens_per_s"]
        print(
            f"  stream / memory tokens/s {ratio:.2f}x (target >= 0.8); stream peak "
            f"{best['stream']['peak_extra'] / MiB:.1f} MiB vs limit + one chunk's hidden states + 300 MiB "
            f"= {bound / MiB:.1f} MiB"
        )
    if "offload" in best and "stream" in best:
        print(
            f"  accelerate offload / stream tokens/s "
            f"{best['offload']['tokens_per_s'] / best['stream']['tokens_per_s']:.2f}x, peak "
            f"{best['offload']['peak_extra'] / best['stream']['peak_extra']:.2f}x"
        )


if __name__ == "__main__":
    main()
