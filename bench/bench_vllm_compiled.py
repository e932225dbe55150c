"""vLLM's compiled mode under hookscope's consent ("hold_eager") against an eager engine, per new token,
side by side in one process.

    .venv-vllm/bin/python bench/bench_vllm_compiled.py [--prompts 16] [--tokens 64] [--new-tokens 32] \\
        [--rounds 5]

Two engines on one tiny random Llama (d_model 256, 4 heads, 2 layers), vLLM's default layout, float32,
prefix caching off: one compiled (vLLM's default compilation on the CPU backend) made with
`compile_policy="hold_eager"`, one eager (`enforce_eager=True`). On each, bench_vllm.py's generation
measures (greedy, EOS ignored, N new tokens per request): plain `llm.generate`, `hs.generate` capturing
one point, `hs.generate` with one `hs.steer`; every measure of both engines in each round, in turn;
medians. `--custom-ops`: a third engine, compiled with vLLM's CPU kernels in the graph
(`compilation_config={"custom_ops": ["all"]}`), which its uncompiled forwards then call too. Prints
the engines' starts and each measure per new token against the compiled engine's plain
generate (the speed a consented engine keeps for its plain requests).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_vllm import generation_cases, in_turns, random_prompts

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "engines"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--custom-ops",
        action="store_true",
        help="a third engine: compiled, hold_eager, vLLM's CPU kernels on",
    )
    args = parser.parse_args()

    from vllm_models import engine, save

    from hookscope.engines import vllm as hv

    prompts = random_prompts(args.prompts, args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        directory = save("llama", Path(tmp))
        kinds = {
            "compiled, hold_eager": {"compile_policy": "hold_eager"},
            "eager": {"compile_policy": "off"},
        }
        if args.custom_ops:
            kinds["compiled, hold_eager, custom_ops all"] = {
                "compile_policy": "hold_eager",
                "compilation_config": {"custom_ops": ["all"]},
            }
        engines = {}
        for name, options in kinds.items():
            start = time.perf_counter()
            engines[name] = engine(directory, enable_prefix_caching=False, **options)
            print(f"{name} engine start: {time.perf_counter() - start:.1f} s (load {os.getloadavg()[0]:.1f})")
        cases = {
            f"{name}: {case}": run
            for name, llm in engines.items()
            for case, run in generation_cases(llm, prompts, args.new_tokens).items()
        }
        times = in_turns(cases, args.rounds)
        for llm in engines.values():
            hv.shut_down(llm)
    tokens = args.prompts * args.new_tokens
    base = statistics.median(next(iter(times.values())))  # the compiled engine's plain generate
    for name, values in times.items():
        med = statistics.median(values)
        print(f"{name}: {med / tokens * 1e3:.3f} ms per new token ({med * 1e3:.1f} ms), {med / base:.3f}x")
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
