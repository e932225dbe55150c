"""Capture from a model bigger than what a capture needs (issue 29): `hs.load(..., points=[...])`
against the full load, and against accelerate's own disk offload.

The model: Llama-shaped, 16 blocks, d_model 1024, d_mlp 2816, vocab 32000, saved once in float32
safetensors (1.08 GB) under bench/out/, seeded. Every configuration runs in a fresh process and
loads it with `dtype=torch.bfloat16`, as the issue measured, so every weight it needs is read and
converted (a load without conversion is zero-copy from the memory map and would hide the cost).

Per configuration: seconds to load, peak RSS (VmHWM) above the process's RSS before loading, the
bytes of the weights it materialized, and tokens/s of `hs.collect` of one point (median of
--runs passes, after one warm-up). Ratios printed: points= peak / (its weights + activations),
points= tokens/s / the full load's.

    python bench/bench_big.py            # blocks.1, blocks.8, blocks.15; full, points=, offload
    python bench/bench_big.py --quick    # one run per configuration
    python bench/bench_big.py --device cuda --quick   # on a GPU (scripts/gpu-suite): peak device
                                         # memory (max_memory_allocated) instead of RSS, 8 x 512 tokens
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

BIG_DIR = common.OUT_DIR / "llama-1g-f32"
SHAPE = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=16,
    vocab_size=32000,
    max_position_embeddings=512,
)
BATCH, SEQ = 2, 64
GPU_BATCH, GPU_SEQ = 8, 512  # a GPU at 2 x 64 times kernel launches, not the load's effect
MODES = ("full", "points", "offload")


def ensure_big_model() -> Path:
    """Build the float32 model once (seeded); never committed (bench/out/ is ignored)."""
    if (BIG_DIR / "ready").exists():
        return BIG_DIR
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(common.SEED)
    config = LlamaConfig(**SHAPE, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    LlamaForCausalLM(config).eval().save_pretrained(BIG_DIR)
    (BIG_DIR / "ready").write_text("ok\n")
    return BIG_DIR


def block_bytes(dtype_bytes: int = 2) -> int:
    d, m = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    return (4 * d * d + 3 * d * m + 2 * d) * dtype_bytes


def load_model(mode: str, point: str, folder: str, device: str):
    import torch

    import hookscope as hs

    if mode == "full":
        return hs.load(str(BIG_DIR), dtype=torch.bfloat16, tokenizer=False, device=device).model
    if mode == "points":
        return hs.load(
            str(BIG_DIR), dtype=torch.bfloat16, tokenizer=False, device=device, points=[point]
        ).model
    # accelerate's offload: two blocks' worth of memory where it runs, the rest on disk (CPU) or in
    # host memory (GPU: what a user with a too-small card reaches for)
    from transformers import AutoModelForCausalLM

    room = {"cpu": 2 * block_bytes()} if device == "cpu" else {0: 2 * block_bytes(), "cpu": "64GiB"}
    return AutoModelForCausalLM.from_pretrained(
        BIG_DIR, dtype=torch.bfloat16, device_map="auto", max_memory=room, offload_folder=folder
    ).eval()


def input_device(model):
    weight = model.get_input_embeddings().weight
    return "cpu" if weight.is_meta else weight.device


def peak_now(device: str) -> int:
    """RSS high-water mark on CPU; the allocator's peak on a GPU (device memory is what a GPU lacks)."""
    import torch

    return common.rss_bytes()[1] if device == "cpu" else torch.cuda.max_memory_allocated()


def worker(mode: str, point: str, runs: int, device: str) -> None:
    common.setup_process()
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401  (imports are not the load's memory)
    from transformers import AutoModelForCausalLM  # noqa: F401

    import hookscope as hs

    batch, seq = (BATCH, SEQ) if device == "cpu" else (GPU_BATCH, GPU_SEQ)
    ids = common.input_ids(SHAPE["vocab_size"], batch=batch, seq=seq).to(device)
    warm_kernels()
    before = common.rss_bytes()[0] if device == "cpu" else torch.cuda.memory_allocated()
    common.reset_rss_peak()
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()

    def capture():
        out = hs.collect(model, ids, point)
        if device != "cpu":
            torch.cuda.synchronize()
        return out

    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        model = load_model(mode, point, folder, device)
        load_s = time.perf_counter() - start
        weights = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == device)
        if mode == "offload":  # accelerate moves inputs only into the modules it hooked
            ids = ids.to(input_device(model))
        if device != "cpu":  # a GPU idles at a low clock: one warm-up call is ~1 ms, not enough to raise it
            until = time.perf_counter() + 1.0
            while time.perf_counter() < until:
                capture()
        times = common.time_runs(capture, runs)  # after one warm-up
        peak = peak_now(device)
        out = capture()[point]
    common.emit(
        {
            "mode": mode,
            "point": point,
            "device": device,
            "load_s": load_s,
            "weights": weights,
            "peak_extra": peak - before,
            "tokens_per_s": batch * seq / common.median(times),
            "best_tokens_per_s": batch * seq / min(times),
            "batch": batch,
            "seq": seq,
            "sum": float(out.float().sum()),
            "dtype": str(out.dtype),
            "torch": torch.__version__,
        }
    )


def warm_kernels() -> None:
    """One capture from a tiny bfloat16 Llama before the baseline is read, so the pages of library
    code that the first forward touches (kernels, hookscope) are not counted as the load's memory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import hookscope as hs

    tiny = LlamaForCausalLM(
        LlamaConfig(
            **{
                **SHAPE,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "vocab_size": 256,
            }
        )
    )
    tiny = tiny.to(torch.bfloat16).eval()
    hs.collect(tiny, torch.zeros(BATCH, SEQ, dtype=torch.long), "blocks.1.resid_post")


def activation_bytes(batch: int = BATCH, seq: int = SEQ) -> int:
    """The largest activations alive at once in one block (bfloat16): the residual stream, q/k/v,
    the MLP's three d_mlp-wide tensors, the attention scores."""
    d, m, heads = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_attention_heads"]
    return batch * seq * (5 * d + 3 * m) * 2 + batch * heads * seq * seq * 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs=3, metavar=("MODE", "POINT", "RUNS"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: peak device memory, 8 x 512 tokens")
    args = parser.parse_args()
    if args.worker:
        mode, point, runs = args.worker
        return worker(mode, point, int(runs), args.device)
    ensure_big_model()
    runs = 1 if args.quick else 5
    n = SHAPE["num_hidden_layers"]
    results = []
    for point in ("blocks.1.resid_post", f"blocks.{n // 2}.resid_post", f"blocks.{n - 1}.resid_post"):
        modes = MODES if point.startswith(f"blocks.{n - 1}.") else MODES[:2]
        row = {
            mode: common.run_fresh(
                args.python,
                Path(__file__),
                ["--worker", mode, point, str(runs), "--device", args.device],
                env=common.MEMORY_ENV,
            )
            for mode in modes
        }
        results.append((point, row))
        report(point, row)


def report(point: str, row: dict) -> None:
    mib = 2**20
    where = next((r for r in row.values() if "error" not in r), {})
    print(
        f"\n{point} on {where.get('device', '?')}, {where.get('batch')} x {where.get('seq')} tokens"
        f" (peak: {'RSS' if where.get('device') == 'cpu' else 'allocated device memory'})"
    )
    for mode, r in row.items():
        if "error" in r:
            print(f"  {mode:8s} ERROR {r['error']}")
            continue
        print(
            f"  {mode:8s} load {r['load_s']:6.2f} s  weights in memory {r['weights'] / mib:7.1f} MiB  "
            f"peak +{r['peak_extra'] / mib:7.1f} MiB  tokens/s median {r['tokens_per_s']:6.1f} "
            f"best {r['best_tokens_per_s']:6.1f}  sum {r['sum']:.4g}"
        )
    full, part = row.get("full", {}), row.get("points", {})
    if "error" not in full and "error" not in part:
        needed = part["weights"] + activation_bytes(part["batch"], part["seq"])
        print(
            f"  points= peak / (weights + activations {needed / mib:.1f} MiB) = "
            f"{part['peak_extra'] / needed:.2f}x;"
            f" peak vs full load {part['peak_extra'] / full['peak_extra']:.2f}x;"
            f" tokens/s vs full load {part['tokens_per_s'] / full['tokens_per_s']:.2f}x median,"
            f" {part['best_tokens_per_s'] / full['best_tokens_per_s']:.2f}x best;"
            f" same values: {part['sum'] == full['sum']}"
        )
    offload = row.get("offload", {})
    if offload and "error" not in offload and "error" not in part:
        print(
            f"  accelerate offload: tokens/s "
            f"{offload['tokens_per_s'] / part['tokens_per_s']:.2f}x points= median,"
            f" {offload['best_tokens_per_s'] / part['best_tokens_per_s']:.2f}x best,"
            f" peak {offload['peak_extra'] / part['peak_extra']:.2f}x points="
        )


if __name__ == "__main__":
    main()
