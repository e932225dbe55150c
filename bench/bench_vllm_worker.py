"""hookscope's own CPU inside a vLLM worker, per forward: what `hs.generate` adds to each forward.

    PYTHONPATH=src .venv-vllm/bin/python bench/bench_vllm_worker.py [--rounds 5] [--profile]

One engine in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: the worker's hooks run in this
process, where they can be timed), a tiny random Llama (tests/engines/vllm_models.py), 16 prompts x
64 tokens, 32 new tokens, greedy. Per round, in turns: plain `llm.generate`, `hs.generate` capturing
`blocks.1.resid_post`, `hs.generate` with one `hs.steer`. The worker's root pre-hook
(`Forwards._pass_start`) and every point hook are wrapped with `time.thread_time_ns`: thread CPU
time, so other processes' load is not counted as ours (on a loaded machine it still grows: take
the medians of several rounds, and compare two trees by running this for each in turns, the same
settings). Prints, per case, the medians per forward. `--profile`: one more call of each hookscope
case under cProfile, printing the function calls hookscope's hooks make per forward (a count, the
same on any load), and one more with hookscope's thread CPU in the call outside the engine's
`generate` (its checks, the workers' start and take, the rows' handoff).
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "engines"))

spent = {"pre": 0, "point": 0, "forwards": 0}
profiler: list[cProfile.Profile | None] = [None]


def timed(fn, part: str):
    """`fn`, its thread CPU time added to `spent[part]` (and run under the profiler, when one is on)."""

    def wrapper(*args, **kwargs):
        prof = profiler[0]
        if prof is not None:
            prof.enable()
        start = time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[part] += time.thread_time_ns() - start
            spent["forwards"] += part == "pre"
            if prof is not None:
                prof.disable()

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    import torch
    from vllm import SamplingParams
    from vllm_models import engine, save

    import hookscope as hs
    from hookscope.engines.vllm import worker

    hooks = importlib.import_module("hookscope.hooks")  # (hs.hooks is the verb)
    worker.Forwards._pass_start = timed(worker.Forwards._pass_start, "pre")
    hooks._OnOutput.__call__ = timed(hooks._OnOutput.__call__, "point")
    hooks._OnInput.__call__ = timed(hooks._OnInput.__call__, "point")

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(1, 250, (64,), generator=g).tolist() for _ in range(16)]
    steer = hs.steer("blocks.0.resid_post", torch.randn(256, generator=torch.Generator().manual_seed(1)))
    with tempfile.TemporaryDirectory() as tmp:
        llm = engine(save("llama", Path(tmp)), in_process=True, enable_prefix_caching=False)
        plain = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, detokenize=False)
        prompts = [{"prompt_token_ids": p} for p in ids]
        cases = {
            "plain": lambda: llm.generate(prompts, plain, use_tqdm=False),
            "one point": lambda: hs.generate(
                llm, ids, "blocks.1.resid_post", max_new_tokens=32, ignore_eos=True
            ),
            "one steer": lambda: hs.generate(llm, ids, edits=[steer], max_new_tokens=32, ignore_eos=True),
        }
        for run in cases.values():  # warm-up
            run()
        per_forward: dict[str, dict[str, list[float]]] = {name: {"pre": [], "point": []} for name in cases}
        load = os.getloadavg()[0]
        for _ in range(args.rounds):
            for name, run in cases.items():
                spent.update(pre=0, point=0, forwards=0)
                run()
                for part in ("pre", "point"):
                    if spent["forwards"]:
                        per_forward[name][part].append(spent[part] / spent["forwards"] / 1e3)
        print(f"load {load:.1f} -> {os.getloadavg()[0]:.1f}; hookscope from {Path(hs.__file__).parent}")
        for name, parts in per_forward.items():
            if parts["pre"]:
                pre, point = statistics.median(parts["pre"]), statistics.median(parts["point"])
                print(
                    f"{name}: per forward, thread CPU: root pre-hook {pre:.1f} us, point hooks {point:.1f} us"
                )
        if args.profile:
            for name in ("one point", "one steer"):
                profile_call(name, cases[name])
        llm.llm_engine.engine_core.shutdown()


def profile_call(name: str, run) -> None:
    """The function calls hookscope's hooks make per forward (a count: the same on any load) and
    hookscope's thread CPU in the call outside the engine's generate."""
    in_hooks = cProfile.Profile()
    profiler[0] = in_hooks
    spent.update(pre=0, point=0, forwards=0)
    run()
    profiler[0] = None
    calls = sum(v[0] for v in pstats.Stats(in_hooks).stats.values()) / max(spent["forwards"], 1)

    whole = cProfile.Profile(time.thread_time_ns, 1e-9)
    whole.enable()
    run()
    whole.disable()
    stats = pstats.Stats(
        whole
    ).stats  # (file, line, function) -> (calls, primitive calls, tottime, cumtime, callers)

    def cumulative(path_end: str, function: str) -> float:
        return sum(v[3] for k, v in stats.items() if k[0].endswith(path_end) and k[2] == function)

    outside = cumulative("engines/vllm/generating.py", "generate") - cumulative(
        "vllm/entrypoints/llm.py", "generate"
    )
    print(
        f"{name}: {calls:.0f} function calls in hookscope's hooks per forward; "
        f"{outside * 1e3:.2f} ms of thread CPU in the call outside the engine's generate"
    )


if __name__ == "__main__":
    main()
