"""hookscope's prefill capture on a vLLM engine against plain vLLM, side by side in one process.

    .venv-vllm/bin/python bench/bench_vllm.py [--prompts 16] [--tokens 128] [--rounds 5]

A tiny random Llama (d_model 256, 4 heads, 2 layers; save_pretrained to a temporary directory),
one engine in vLLM's default layout (engine core and worker in their own processes), float32,
eager. Measured: the engine's start; per round, plain `llm.generate(prompts, max_tokens=1)` (the
same prefill work) and `hs.collect(llm, prompts, POINT)` for one point and for every block's
resid_post, taking turns; medians. Prints one line per measure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "engines"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    import torch
    from vllm import SamplingParams
    from vllm_models import engine, save, shut

    import hookscope as hs

    g = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(1, 250, (args.tokens,), generator=g).tolist()}
        for _ in range(args.prompts)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        directory = save("llama", Path(tmp))
        start = time.perf_counter()
        llm = engine(directory)
        took, load = time.perf_counter() - start, os.getloadavg()[0]
        print(f"engine start: {took:.1f} s (default layout, load {load:.1f})")
        plain = SamplingParams(max_tokens=1, detokenize=False, skip_reading_prefix_cache=True)
        cases = {
            "plain generate(max_tokens=1)": lambda: llm.generate(prompts, plain, use_tqdm=False),
            "hs.collect blocks.1.resid_post": lambda: hs.collect(llm, prompts, "blocks.1.resid_post"),
            "hs.collect blocks.*.resid_post": lambda: hs.collect(llm, prompts, "blocks.*.resid_post"),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for run in cases.values():  # warm-up
            run()
        for _ in range(args.rounds):
            for name, run in cases.items():
                t = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t)
        shut(llm)
    base = statistics.median(times["plain generate(max_tokens=1)"])
    tokens = args.prompts * args.tokens
    for name, values in times.items():
        med = statistics.median(values)
        rate = tokens / med
        print(
            f"{name}: {med * 1e3:.1f} ms for {tokens} tokens ({rate:,.0f} tokens/s), {med / base:.3f}x plain"
        )
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
