"""What `--max-memory` leaves the process using (issue 34, item 6): the peak resident set (VmHWM
of a fresh process: ru_maxrss would carry the parent's peak across exec) of an extraction of a
late block under `max_memory`, against the target `limit + one chunk + 300 MB`, and its tokens/s
against the same extraction in memory.

Two models share one float32 checkpoint (bench_big.py's Llama shape: 16 blocks, d_model 1024,
float32 safetensors, 1.08 GB, built once under /tmp, never committed):
- `same`: computed in float32, the checkpoint's dtype;
- `convert`: its config says bfloat16, so every block is converted from float32 as it is read.

The limit: the weights the streamer keeps (outside the blocks + two blocks, in the compute dtype)
+ room for a chunk of CHUNK batches' hidden states. "One chunk" in the target is that room. The
peak is also set against two baselines, each the resident set of a fresh process: python + torch +
transformers imported (`--worker imports`; `--worker modelcode` adds the model's code alone), and
the process's own: that, plus hookscope and the
model's code imported (a `meta` load, no weight read; transformers' model code brings in
torch._dynamo, torch.distributed.tensor, scipy and accelerate). The allocator is left as users have
it (no MALLOC_* settings). Each run is a fresh process; medians.

    python bench/bench_stream_memory.py              # 3 runs per mode and model
    python bench/bench_stream_memory.py --quick      # 1 run
    python bench/bench_stream_memory.py --src /tmp/before --modes stream   # another checkout's hookscope
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_big  # noqa: E402
import bench_stream  # noqa: E402
import common  # noqa: E402

ROOT = Path(tempfile.gettempdir()) / "hookscope-bench-memory"
MODELS = {"same": "float32", "convert": "bfloat16"}  # model -> compute dtype (the checkpoint: float32)
POINT = "blocks.13.resid_post"
BATCH, CONTEXT, TOKENS, CHUNK = 4, 128, 4096, 4  # 8 batches: two chunks of 4
MiB, MB = 2**20, 10**6


def model_dir(name: str) -> Path:
    return ROOT / name


def ensure_models() -> None:
    """The float32 checkpoint once (seeded), and a second directory whose config asks bfloat16."""
    same, convert = model_dir("same"), model_dir("convert")
    if (convert / "ready").exists():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hookscope.testing import train_tokenizer

    torch.manual_seed(common.SEED)
    config = LlamaConfig(**bench_big.SHAPE, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    LlamaForCausalLM(config).eval().save_pretrained(same)
    train_tokenizer(512).save_pretrained(same)
    convert.mkdir(parents=True, exist_ok=True)
    for file in same.iterdir():
        if file.suffix == ".safetensors":
            (convert / file.name).unlink(missing_ok=True)
            (convert / file.name).symlink_to(file)
        elif file.name != "config.json":
            shutil.copy(file, convert / file.name)
    settings = json.loads((same / "config.json").read_text())
    (convert / "config.json").write_text(json.dumps({**settings, "dtype": "bfloat16"}, indent=2))
    (convert / "ready").write_text("ok\n")


def compute_itemsize(name: str) -> int:
    return 4 if MODELS[name] == "float32" else 2


def weights_kept(name: str) -> int:
    """Embeddings and final norm (the head is not needed before the last block) + two blocks, in the
    compute dtype: the plan's weight limit."""
    shape = bench_big.SHAPE
    outside = (shape["vocab_size"] + 1) * shape["hidden_size"]
    return (outside + 2 * bench_big.block_bytes(1)) * compute_itemsize(name)


def chunk_bytes(name: str) -> int:
    """A chunk's hidden states (a block's input and output) and kept bfloat16 rows, as the plan
    counts them."""
    return CHUNK * BATCH * CONTEXT * bench_big.SHAPE["hidden_size"] * (2 * compute_itemsize(name) + 2)


def limit_bytes(name: str) -> int:
    half_a_batch = chunk_bytes(name) // (2 * CHUNK)  # a chunk of CHUNK batches, not more
    return weights_kept(name) + chunk_bytes(name) + half_a_batch


def status_kib() -> dict[str, int]:
    text = Path("/proc/self/status").read_text()
    return {k: int(v) * 1024 for k, v in re.findall(r"^(VmHWM|VmRSS|RssAnon|RssFile):\s+(\d+)", text, re.M)}


def worker(mode: str, name: str) -> None:
    common.setup_process()
    if mode == "imports":  # python + torch + transformers, nothing else
        common.emit({"mode": mode, "model": name, "rss": status_kib()["VmRSS"]})
        return
    if mode == "modelcode":  # + the model's code (what transformers' modeling files import), no hookscope
        import transformers.models.llama.modeling_llama  # noqa: F401

        common.emit({"mode": mode, "model": name, "rss": status_kib()["VmRSS"]})
        return
    import hookscope as hs
    from hookscope.extract import ExtractConfig, extract

    # the process's own: torch, transformers, hookscope and the model's code imported, no weight read
    hs.load(str(model_dir(name)), device="meta")
    own = status_kib()
    baseline = own["VmRSS"]
    with tempfile.TemporaryDirectory() as folder:
        data = bench_stream.corpus(folder, docs=120)  # 8 batches of 4 x 128 tokens
        start = time.perf_counter()
        summary = extract(
            ExtractConfig(
                out=f"{folder}/store",
                model=str(model_dir(name)),
                points=[POINT],
                data=data,
                context=CONTEXT,
                batch_size=BATCH,
                max_tokens=TOKENS,
                dtype="bfloat16",
                drop_bos=False,
                progress=False,
                max_memory=limit_bytes(name) if mode == "stream" else None,
            )
        )
        seconds = time.perf_counter() - start
    end = status_kib()
    common.emit(
        {
            "mode": mode,
            "model": name,
            "tokens_per_s": summary.rows / seconds,
            "peak": end["VmHWM"],
            "baseline": baseline,
            "anon_end": end["RssAnon"],
            "file_growth": end["RssFile"] - own["RssFile"],
            "chunk_batches": chunk_batches(name),
        }
    )


def chunk_batches(name: str) -> int:
    import torch

    import hookscope as hs
    from hookscope.loading.stream_plan import plan_stream

    loaded = hs.load(str(model_dir(name)), device="meta", tokenizer=False)
    return plan_stream(
        loaded.model,
        loaded.arch,
        [POINT],
        limit_bytes(name),
        batch_size=BATCH,
        context=CONTEXT,
        store_itemsize=torch.bfloat16.itemsize,
    ).chunk_batches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "MODEL"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--src", help="import hookscope from this checkout's src/ (the code before a change)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--modes", default="memory,stream")
    parser.add_argument("--python", default=sys.executable)
    args = parser.parse_args()
    if args.src:
        common.use_source(args.src)
    if args.worker:
        return worker(*args.worker)
    ensure_models()
    runs = 1 if args.quick else args.runs
    print(f"load before: {os.getloadavg()[0]:.2f}")
    imports = common.median(
        [
            common.run_fresh(args.python, Path(__file__), ["--worker", "imports", "same"])["rss"]
            for _ in range(runs)
        ]
    )
    print(f"python + torch + transformers imported: {imports / MB:.1f} MB")
    code = common.median(
        [
            common.run_fresh(args.python, Path(__file__), ["--worker", "modelcode", "same"])["rss"]
            for _ in range(runs)
        ]
    )
    print(
        f"  + the model's code (modeling_llama and what it imports): {code / MB:.1f} MB "
        f"(+{(code - imports) / MB:.1f})"
    )
    for name in args.models.split(","):
        rows = {
            mode: [
                common.run_fresh(args.python, Path(__file__), ["--worker", mode, name]) for _ in range(runs)
            ]
            for mode in args.modes.split(",")
        }
        report(name, rows, imports, code)
    print(f"load after: {os.getloadavg()[0]:.2f}")


def report(name: str, rows: dict[str, list[dict]], imports: int, code: int) -> None:
    print(
        f"\n{name}: float32 checkpoint computed in {MODELS[name]}; extract {POINT}, {TOKENS} tokens in "
        f"batches of {BATCH}x{CONTEXT}; limit {limit_bytes(name) / MB:.1f} MB (weights kept "
        f"{weights_kept(name) / MB:.1f} + chunk room)"
    )
    best = {}
    for mode, results in rows.items():
        ok = [r for r in results if "error" not in r]
        if not ok:
            print(f"  {mode:7s} ERROR {results[0]['error']}")
            continue
        med = {
            k: common.median([r[k] for r in ok])
            for k in ("tokens_per_s", "peak", "baseline", "anon_end", "file_growth")
        }
        best[mode] = med
        print(
            f"  {mode:7s} {med['tokens_per_s']:8.1f} tokens/s  peak RSS {med['peak'] / MB:7.1f} MB  "
            f"(the process's own {med['baseline'] / MB:.1f}, anon at end {med['anon_end'] / MB:.1f}, "
            f"file-backed pages mapped in by the run {med['file_growth'] / MB:+.1f}; runs: "
            + ", ".join(f"{r['tokens_per_s']:.0f} t/s {r['peak'] / MB:.0f} MB" for r in ok)
            + ")"
            + (f" chunk {ok[0]['chunk_batches']} batches" if mode == "stream" else "")
        )
    if len(best) == 2:
        ratio = best["stream"]["tokens_per_s"] / best["memory"]["tokens_per_s"]
        print(f"  stream / memory tokens/s {ratio:.2f}x (target >= 0.8)")
    if "stream" in best:
        peak, own, pages = best["stream"]["peak"], best["stream"]["baseline"], best["stream"]["file_growth"]
        print(
            f"  the floor: python + torch + transformers {imports / MB:.1f} MB, the model's code "
            f"+{(code - imports) / MB:.1f}, hookscope + the meta load + tokenizer +{(own - code) / MB:.1f} "
            f"= the process's own {own / MB:.1f}; library pages the run maps in +{pages / MB:.1f}; "
            f"the rest (weights, the chunk, a pass's working memory) {(peak - own - pages) / MB:.1f} MB "
            f"beside limit + one chunk = {(limit_bytes(name) + chunk_bytes(name)) / MB:.1f} MB"
        )
        for what, own in (
            ("300 MB", 300 * MB),
            ("python + torch + transformers", imports),
            ("the process's own", best["stream"]["baseline"]),
        ):
            target = limit_bytes(name) + chunk_bytes(name) + own
            print(
                f"  stream peak {peak / MB:.1f} MB vs limit + one chunk + {what} = {target / MB:.1f} MB "
                f"({'within' if peak <= target else 'OVER'} by {abs(target - peak) / MB:.1f} MB)"
            )


if __name__ == "__main__":
    main()
