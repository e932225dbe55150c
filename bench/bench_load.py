"""A model's first load in a fresh process: `hs.load` against transformers' own `from_pretrained`
(model and tokenizer where the model has one, eval mode), and how much of each is Python's cyclic
garbage collector.

Each configuration runs in its own process, which imports torch and transformers (and hookscope,
for hookscope's) before the clock starts, then times the load and the first forward after it
(2 x 64 tokens: a full collection held back during the load runs at the latest there, so the sum
is what a user waits for). The collector's time is summed per generation through `gc.callbacks`.
Configurations take turns within each round, in a rotated order; medians over the rounds.

    python bench/bench_load.py                      # GPT-2-small shape, 5 rounds
    python bench/bench_load.py --rounds 3 --model big   # the 1.08 GB float32 Llama of bench_big.py
    python bench/bench_load.py --src /tmp/before    # also hookscope from another checkout's src/
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def _worker(kind: str, path: str) -> None:
    spent = {0: 0.0, 1: 0.0, 2: 0.0}
    runs = {0: 0, 1: 0, 2: 0}
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            spent[info["generation"]] += time.perf_counter() - started[0]
            runs[info["generation"]] += 1

    common.setup_process()
    import torch
    import transformers

    if kind == "hookscope":
        import hookscope as hs
    with_tokenizer = (Path(path) / "tokenizer.json").exists()  # bench_big's model has none
    gc.callbacks.append(timed)
    t0 = time.perf_counter()
    if kind == "hookscope":
        model = hs.load(path, tokenizer=with_tokenizer).model
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        if with_tokenizer:
            transformers.AutoTokenizer.from_pretrained(path)
    t1 = time.perf_counter()
    load_full = (runs[2], spent[2])
    ids = common.input_ids(model.config.vocab_size, batch=2, seq=64)
    with torch.no_grad():
        model(ids)
    t2 = time.perf_counter()
    common.emit(
        {
            "load_s": t1 - t0,
            "forward_s": t2 - t1,
            "total_s": t2 - t0,
            "full_collections_in_load": load_full[0],
            "full_collection_s_in_load": load_full[1],
            "full_collections": runs[2],
            "collector_s": sum(spent.values()),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", choices=("gpt2-small", "big"), default="gpt2-small")
    parser.add_argument("--src", help="also run hookscope from this checkout's src/ (`hookscope-src`)")
    parser.add_argument("--worker", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(*args.worker)
    if args.model == "big":
        import bench_big

        path = bench_big.ensure_big_model()
    else:
        common.ensure_models()
        path = common.GPT2_SMALL_DIR
    configs = {"hookscope": ("hookscope", {}), "transformers": ("transformers", {})}
    if args.src:
        configs["hookscope-src"] = ("hookscope", common.source_env(args.src))
    names = list(configs)
    results: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            kind, env = configs[name]
            out = common.run_fresh(sys.executable, Path(__file__), ["--worker", kind, str(path)], env=env)
            if "error" in out:
                raise SystemExit(f"{name}: {out['error']}")
            results[name].append(out)
            print(
                f"round {r + 1} {name:14s} load {out['load_s']:.3f} s, "
                f"then forward {out['forward_s']:.3f} s; "
                f"full collections in the load {out['full_collections_in_load']} "
                f"({out['full_collection_s_in_load']:.3f} s), collector in all {out['collector_s']:.3f} s",
                flush=True,
            )
    med = {n: {k: common.median([o[k] for o in results[n]]) for k in results[n][0]} for n in names}
    print(f"\n{path.name}, medians of {args.rounds} rounds (load / load + first forward / collector):")
    for n in names:
        m = med[n]
        print(
            f"  {n:14s} {m['load_s']:.3f} s / {m['total_s']:.3f} s / {m['collector_s']:.3f} s "
            f"(full collections in the load: {m['full_collections_in_load']:.0f})"
        )
    base = med["transformers"]
    for n in names:
        if n != "transformers":
            print(
                f"  {n} / transformers: load {med[n]['load_s'] / base['load_s']:.3f}, "
                f"load + forward {med[n]['total_s'] / base['total_s']:.3f}"
            )
    if args.src:
        now, before = med["hookscope"], med["hookscope-src"]
        print(
            f"  hookscope / hookscope-src: load {now['load_s'] / before['load_s']:.3f}, "
            f"load + forward {now['total_s'] / before['total_s']:.3f}"
        )


if __name__ == "__main__":
    main()
