"""hookscope's prefill capture on a vLLM engine against plain vLLM, side by side in one process.

    .venv-vllm/bin/python bench/bench_vllm.py [--prompts 16] [--tokens 128] [--rounds 5] [--new-tokens 0]

A tiny random Llama (d_model 256, 4 heads, 2 layers; save_pretrained to a temporary directory),
one engine in vLLM's default layout (engine core and worker in their own processes), float32,
eager. Measured: the engine's start; per round, plain `llm.generate(prompts, max_tokens=1)` (the
same prefill work) and `hs.collect(llm, prompts, POINT)` for one point and for every block's
resid_post, taking turns; medians. With `--new-tokens N`, also generation (greedy, EOS ignored so
every request makes N tokens): plain `llm.generate(prompts, max_tokens=N)` against `hs.generate`
capturing one point (it asks vLLM for N + 1 tokens: the last one it keeps is run, as Hugging Face's
hs.generate runs it) and `hs.generate` with one `hs.steer` on every request, in the same turns.
Prefix caching is off (edits refuse it; hookscope's requests skip reading it anyway). Prints one
line per measure, each against the plain run of its own kind.
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
    parser.add_argument("--new-tokens", type=int, default=0, help="also time generation of N tokens")
    args = parser.parse_args()

    from vllm import SamplingParams
    from vllm_models import engine, save

    import hookscope as hs
    from hookscope.engines import vllm as hv

    prompts = random_prompts(args.prompts, args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        directory = save("llama", Path(tmp))
        start = time.perf_counter()
        llm = engine(directory, enable_prefix_caching=False)
        took, load = time.perf_counter() - start, os.getloadavg()[0]
        print(f"engine start: {took:.1f} s (default layout, load {load:.1f})")
        plain = SamplingParams(max_tokens=1, detokenize=False, skip_reading_prefix_cache=True)
        cases = {
            "plain generate(max_tokens=1)": lambda: llm.generate(prompts, plain, use_tqdm=False),
            "hs.collect blocks.1.resid_post": lambda: hs.collect(llm, prompts, "blocks.1.resid_post"),
            "hs.collect blocks.*.resid_post": lambda: hs.collect(llm, prompts, "blocks.*.resid_post"),
        }
        cases.update(generation_cases(llm, prompts, args.new_tokens))
        times = in_turns(cases, args.rounds)
        hv.shut_down(llm)  # the core given time to remove its shared memory
    for name, values in times.items():
        generating = name.startswith(GENERATE)
        base = statistics.median(times[PLAIN_GENERATE if generating else "plain generate(max_tokens=1)"])
        tokens = args.prompts * (args.new_tokens if generating else args.tokens)
        med = statistics.median(values)
        print(
            f"{name}: {med * 1e3:.1f} ms for {tokens} {'new' if generating else 'prompt'} tokens "
            f"({tokens / med:,.0f} tokens/s), {med / base:.3f}x plain"
        )
    print(f"load after: {os.getloadavg()[0]:.1f}")


def random_prompts(n: int, tokens: int) -> list[dict]:
    """`n` prompts of `tokens` random token ids each, the same every run."""
    import torch

    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(1, 250, (tokens,), generator=g).tolist()} for _ in range(n)]


def in_turns(cases: dict, rounds: int) -> dict[str, list[float]]:
    """Each case's seconds per round: every case run once to warm up, then all in turn, `rounds` times."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for run in cases.values():
        run()
    for _ in range(rounds):
        for name, run in cases.items():
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
    return times


GENERATE = "generate "
PLAIN_GENERATE = "generate N: plain vLLM"


def generation_cases(llm, prompts: list, new_tokens: int) -> dict:
    """The generation measures (none for 0 new tokens), greedy, every request making `new_tokens`."""
    if not new_tokens:
        return {}
    import torch
    from vllm import SamplingParams

    import hookscope as hs

    plain = SamplingParams(
        max_tokens=new_tokens,
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        skip_reading_prefix_cache=True,
    )
    steer = hs.steer("blocks.0.resid_post", torch.randn(256, generator=torch.Generator().manual_seed(1)))
    ids = [p["prompt_token_ids"] for p in prompts]
    return {
        PLAIN_GENERATE: lambda: llm.generate(prompts, plain, use_tqdm=False),
        f"{GENERATE}N: hs.generate blocks.1.resid_post": lambda: hs.generate(
            llm, ids, "blocks.1.resid_post", max_new_tokens=new_tokens, ignore_eos=True
        ),
        f"{GENERATE}N: hs.generate, one hs.steer": lambda: hs.generate(
            llm, ids, edits=[steer], max_new_tokens=new_tokens, ignore_eos=True
        ),
    }


if __name__ == "__main__":
    main()
