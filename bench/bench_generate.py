"""Generation with hooks (issue 16): per-token latency of greedy generation, hookscope and its
peers side by side on the same weights, every configuration in fresh processes, 2 threads.

    .venv-bench/bin/python bench/bench_generate.py                 # full run
    .venv-bench/bin/python bench/bench_generate.py --quick         # smoke run
    .venv-bench/bin/python bench/bench_generate.py --model tiny    # the tiny GPT-2 (overhead-bound)

Configurations (batch 1, a 16-token random prompt, NEW greedy tokens, EOS off so every run makes
exactly NEW tokens; capture and steer act on blocks.5.resid_post, blocks.1 on the tiny model):
  hf              plain Hugging Face generate: the floor
  hand_capture    generate with a plain register_forward_hook appending each step's output
  hs_capture      hs.generate(model, ids, POINT): aligned [1, T, d] (one more cached step for the last token)
  hs_steer        hs.generate(model, ids, edits=[hs.steer(POINT, v)])
  nnsight_capture nnsight .generate() saving the point's output at every step (tracer.iter[:NEW])
  nnsight_steer   nnsight .generate() adding v at every step
  tl3_plain       TransformerLens 3.9 HookedTransformer.generate (its own KV cache)
  tl3_capture     ... with a forward hook appending each step's hook_resid_post
  tl3_steer       ... with a forward hook adding v
Prints ms per generated token (median over processes x runs) and ratios to `hf`; writes raw
figures to bench/out/generate-latest.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

CONFIGS = ("hf", "hand_capture", "hs_capture", "hs_steer", "nnsight_capture", "nnsight_steer",
           "tl3_plain", "tl3_capture", "tl3_steer")
PROMPT = 16
SETTINGS = {"full": {"new": 32, "runs": 5, "rounds": 3}, "quick": {"new": 8, "runs": 2, "rounds": 1}}
MODELS = {"small": (common.GPT2_SMALL_DIR, 5), "tiny": (common.TINY_DIR, 1)}


def steering_vector(d_model: int):
    import torch

    return torch.randn(d_model, generator=torch.Generator().manual_seed(1))


def make_run(config: str, model_name: str, new: int):
    """A zero-argument call that generates `new` tokens as `config` does; returns the token ids."""
    import torch

    import hookscope as hs

    path, layer = MODELS[model_name]
    point, tl_point = f"blocks.{layer}.resid_post", f"blocks.{layer}.hook_resid_post"
    greedy = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    if config.startswith("tl3_"):
        model = common.load_tl3(path)
        ids = common.input_ids(model.cfg.d_vocab, 1, PROMPT)
        vector = steering_vector(model.cfg.d_model)
        kept = []
        hooks = {"tl3_plain": [],
                 "tl3_capture": [(tl_point, lambda act, hook: kept.append(act.detach().clone()))],
                 "tl3_steer": [(tl_point, lambda act, hook: act + vector)]}[config]

        def run():
            kept.clear()
            with model.hooks(fwd_hooks=hooks):
                return model.generate(ids, max_new_tokens=new, stop_at_eos=False, do_sample=False,
                                      verbose=False, use_past_kv_cache=True)
        return run

    model = common.load_hf(path)
    ids = common.input_ids(model.config.vocab_size, 1, PROMPT)
    vector = steering_vector(model.config.n_embd)
    block = model.transformer.h[layer]
    if config == "hf":
        return lambda: model.generate(ids, **greedy)
    if config == "hand_capture":
        def run():
            kept = []
            handle = block.register_forward_hook(lambda m, a, out: kept.append(
                (out if isinstance(out, torch.Tensor) else out[0]).detach().clone()))
            try:
                return model.generate(ids, **greedy)
            finally:
                handle.remove()
        return run
    if config == "hs_capture":
        return lambda: hs.generate(model, ids, point, **greedy).sequences
    if config == "hs_steer":
        return lambda: hs.generate(model, ids, edits=[hs.steer(point, vector)], **greedy).sequences
    if config.startswith("nnsight_"):
        from nnsight import TransformersModel
        from transformers import AutoTokenizer

        wrapped = TransformersModel(model, tokenizer=AutoTokenizer.from_pretrained(path))
        envoy = wrapped.transformer.h[layer]

        def run():
            # a bounded loop over the `new` forward passes (an open tracer.all() loop cuts the
            # statements after it); min_new_tokens makes the count exact
            with wrapped.generate(ids, **greedy) as tracer:
                if config == "nnsight_capture":
                    saved = list().save()
                    for _ in tracer.iter[:new]:
                        saved.append(envoy.output)
                else:
                    for _ in tracer.iter[:new]:
                        envoy.output = envoy.output + vector
                out = tracer.result.save()
            return out
        return run
    raise SystemExit(f"unknown config {config!r}")


def worker(config: str, model_name: str, new: int, runs: int) -> dict:
    import torch

    fn = make_run(config, model_name, new)
    with torch.inference_mode():
        tokens = fn()  # warm-up, and the tokens for the cross-check
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        with torch.inference_mode():
            fn()
        times.append(time.perf_counter() - start)
    first = tokens if isinstance(tokens, torch.Tensor) else getattr(tokens, "sequences", None)
    return {"ms_per_token": [t / new * 1e3 for t in times],
            "tokens": first[0].tolist() if isinstance(first, torch.Tensor) else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default=None, help="run one configuration in this process (worker)")
    parser.add_argument("--model", default="small", choices=sorted(MODELS))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default=None, help="comma-separated configurations")
    parser.add_argument("--new", type=int, default=None)
    parser.add_argument("--runs", type=int, default=None)
    args = parser.parse_args()
    settings = SETTINGS["quick" if args.quick else "full"]
    new = args.new or settings["new"]
    runs = args.runs or settings["runs"]
    if args.case:
        common.setup_process()
        common.emit(worker(args.case, args.model, new, runs))
        return
    common.run_fresh(sys.executable, common.BENCH_DIR / "core_cases.py", ["prepare"])
    configs = args.only.split(",") if args.only else list(CONFIGS)
    results: dict[str, dict] = {c: {"ms_per_token": []} for c in configs}
    loads = []
    for _ in range(settings["rounds"]):  # interleaved, so a change of load falls on every config alike
        for config in configs:
            loads.append(open("/proc/loadavg").read().split()[0])
            out = common.run_fresh(sys.executable, Path(__file__), ["--case", config, "--model", args.model,
                                                                   "--new", str(new), "--runs", str(runs)])
            if "error" in out:
                results[config]["error"] = out["error"]
                continue
            results[config]["ms_per_token"] += out["ms_per_token"]
            results[config]["tokens"] = out["tokens"]
    base = common.median(results["hf"]["ms_per_token"]) if results.get("hf", {}).get("ms_per_token") else None
    print(f"model {args.model}, batch 1, prompt {PROMPT}, {new} new tokens greedy; load 1-min during runs: "
          f"{min(loads, key=float)}-{max(loads, key=float)}")
    print(f"{'config':<16} {'ms/token':>9} {'x hf':>7}  range")
    for config, r in results.items():
        if "error" in r and not r["ms_per_token"]:
            print(f"{config:<16} error: {r['error'][:160]}")
            continue
        med = common.median(r["ms_per_token"])
        ratio = f"{med / base:.3f}" if base else "-"
        low, high = min(r["ms_per_token"]), max(r["ms_per_token"])
        print(f"{config:<16} {med:9.2f} {ratio:>7}  {low:.2f}-{high:.2f}")
    steer = {c: results[c].get("tokens") for c in configs if c.endswith("steer") and results[c].get("tokens")}
    if len(set(map(tuple, steer.values()))) > 1:
        print("note: steered tokens differ between tools:", {c: t[:PROMPT + 4] for c, t in steer.items()})
    elif steer:
        print(f"steered tokens agree across {', '.join(steer)}")
    out_dir = common.OUT_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {"model": args.model, "new": new, "runs": runs, "loads": loads, "results": results,
              "versions": common.run_fresh(sys.executable, common.BENCH_DIR / "core_cases.py", ["versions"])}
    (out_dir / "generate-latest.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
