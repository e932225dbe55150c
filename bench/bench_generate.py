"""Generation with hooks (issue 16): per-token latency of greedy generation with one captured
point and with one steering edit, against plain Hugging Face `generate`, nnsight `.generate()`
and TransformerLens 3.9 `generate` on the same weights. One command, ~4-6 min on a quiet 2-core
machine (longer under load):

    .venv-bench/bin/python bench/bench_generate.py              # GPT-2-small shape, 64 new tokens
    .venv-bench/bin/python bench/bench_generate.py --quick      # smoke run (~1 min)
    .venv-bench/bin/python bench/bench_generate.py --model tiny # the tiny GPT-2: per-call overhead only

Batch 1, a 16-token random prompt, NEW greedy tokens with EOS off (`min_new_tokens`,
`stop_at_eos=False`), so every run makes exactly NEW tokens; capture and steer act on
blocks.5.resid_post (blocks.1 on the tiny model). One thread by default (`--threads`): a batch-1
decoding step is small, and on a shared machine a second OpenMP thread mostly waits for a core at
every barrier (GPT-2-small here, load ~6: 170-190 ms/token with 1 thread, 550-910 with 2).
TransformerLens gets the model's tokenizer, as from_pretrained would give it: without one, its
KV-cache generate (3.9) embeds each new token at a wrong position and its tokens drift from the
other tools' (it then builds the attention mask the cached path needs from the tokenizer).

Built to survive a noisy machine. The configurations are split into three groups, each run in
its own fresh process, and the groups alternate, process after process (hf, nnsight, tl3, hf,
nnsight, tl3, ...). Inside a process every configuration of its group runs once per repetition,
in an order rotated each repetition (ABC, BCA, CAB, ...), and every group holds a plain HF
`generate` on its own copy of the weights. So each timed run has a plain-`generate` partner
measured seconds apart in the same process, and a ratio is the median of those paired ratios
(ROUNDS processes x REPS repetitions of them), with their spread (min-max and interquartile)
printed beside it: load that changes between processes cancels out, and the spread says how far
the ratio can be trusted. The same pairs are also compared in process CPU time (one thread: the
work done, which load stretches far less than wall time).

  group hf       hf              plain Hugging Face generate: the floor (in every group)
                 hand_capture    generate + a plain register_forward_hook appending each step's output
                 hs_capture      hs.generate(model, ids, POINT): aligned [1, T, d] (one more cached
                                 step runs the last token, which generate never feeds back)
                 hand_steer      generate + a plain forward hook adding the vector
                 hs_steer        hs.generate(model, ids, edits=[hs.steer(POINT, v)])
  group nnsight  nnsight_capture nnsight .generate() saving the point's output at every step
                 nnsight_steer   nnsight .generate() adding the vector at every step
  group tl3      tl3_plain       TransformerLens 3.9 HookedTransformer.generate (its own KV cache)
                 tl3_capture     ... + model.hooks appending each step's hook_resid_post
                 tl3_steer       ... + model.hooks adding the vector
Per token, two ways: the whole run's time over its NEW tokens (what a user waits, the run's setup
and finish included: `x hf`), and each extra token's time, from the same configuration run at NEW
and at SHORT = NEW / 4 tokens in the same repetition, (t_NEW - t_SHORT) / (NEW - SHORT), over plain
generate's (`per extra token`: the hooks' cost per step alone). Beside them, counted in one more
fresh process over runs of SHORT and NEW tokens (`common.per_token_counts`): aten ops, host reads of
a tensor's value (`.item()`, `bool(t)`, nonzero: each a wait for the device on a GPU) and Python
calls per generated token, as plain generate's count + what the configuration adds. On a GPU a
small model's decoding step is bound by the host launching kernels, so these counts are what the
CPU figures transfer there (`--batch 32` and `--model tiny` approach that regime here).
Writes raw figures (every paired time) to bench/out/generate-MODEL-latest.json, after every process.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

GROUPS = {
    "hf": ("hf", "hand_capture", "hs_capture", "hand_steer", "hs_steer"),
    "nnsight": ("hf", "nnsight_capture", "nnsight_steer"),
    "tl3": ("hf", "tl3_plain", "tl3_capture", "tl3_steer"),
}
PROMPT = 16
SETTINGS = {"full": {"new": 64, "rounds": 2, "reps": 4}, "quick": {"new": 16, "rounds": 1, "reps": 2}}
BATCH = 1  # (--batch)
MODELS = {"small": (common.GPT2_SMALL_DIR, 5), "tiny": (common.TINY_DIR, 1)}


_SHARED: dict = {}  # the Hugging Face model the plain, hand-written and hookscope runs share


def steering_vector(d_model: int):
    import torch

    return torch.randn(d_model, generator=torch.Generator().manual_seed(1))


def make_run(config: str, model_name: str, new: int, batch: int = 1):
    """A zero-argument call that generates `new` tokens as `config` does; returns the token ids
    [1, PROMPT + new]. The Hugging Face configurations share one copy of the weights (each removes
    its hooks after a run); nnsight and TransformerLens load their own (from the same files)."""
    import torch

    import hookscope as hs

    path, layer = MODELS[model_name]
    point, tl_point = f"blocks.{layer}.resid_post", f"blocks.{layer}.hook_resid_post"
    greedy = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    if config.startswith("tl3_"):
        from transformers import AutoTokenizer

        model = common.load_tl3(path)
        model.set_tokenizer(AutoTokenizer.from_pretrained(path), default_padding_side="right")
        ids = common.input_ids(model.cfg.d_vocab, batch, PROMPT)
        vector = steering_vector(model.cfg.d_model)
        kept = []
        hooks = {
            "tl3_plain": [],
            "tl3_capture": [(tl_point, lambda act, hook: kept.append(act.detach().clone()))],
            "tl3_steer": [(tl_point, lambda act, hook: act + vector)],
        }[config]

        def run():
            kept.clear()
            with model.hooks(fwd_hooks=hooks):
                return model.generate(
                    ids,
                    max_new_tokens=new,
                    stop_at_eos=False,
                    do_sample=False,
                    verbose=False,
                    use_past_kv_cache=True,
                )

        return run

    if config.startswith("nnsight_"):
        model = common.load_hf(path)  # nnsight wraps it: not the copy plain generate runs on
    else:
        model = _SHARED.get(path) or _SHARED.setdefault(path, common.load_hf(path))
    ids = common.input_ids(model.config.vocab_size, batch, PROMPT)
    vector = steering_vector(model.config.n_embd)
    block = model.transformer.h[layer]
    if config == "hf":
        return lambda: model.generate(ids, **greedy)
    if config in ("hand_capture", "hand_steer"):

        def keep(module, args, out):
            kept.append((out if isinstance(out, torch.Tensor) else out[0]).detach().clone())

        def add(module, args, out):
            return out + vector if isinstance(out, torch.Tensor) else (out[0] + vector, *out[1:])

        kept: list = []

        def run():
            kept.clear()
            handle = block.register_forward_hook(keep if config == "hand_capture" else add)
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


def _tokens(result) -> list[int] | None:
    import torch

    seq = result if isinstance(result, torch.Tensor) else getattr(result, "sequences", None)
    return seq[0].tolist() if isinstance(seq, torch.Tensor) else None


def worker(group: str, model_name: str, new: int, reps: int, batch: int) -> dict:
    """Every configuration of `group`, `reps` times each in rotated order, at `new` tokens and right
    after at `new // 4`; seconds per run."""
    import torch

    configs = GROUPS[group]
    short = max(1, new // 4)
    runs = {c: make_run(c, model_name, new, batch) for c in configs}
    short_runs = {c: make_run(c, model_name, short, batch) for c in configs}
    tokens = {}
    with torch.inference_mode():
        for config, fn in runs.items():  # warm-up, and the tokens for the cross-check
            tokens[config] = _tokens(fn())
            short_runs[config]()
    seconds: dict[str, list[float]] = {c: [] for c in configs}
    cpu: dict[str, list[float]] = {c: [] for c in configs}
    short_seconds: dict[str, list[float]] = {c: [] for c in configs}
    for rep in range(reps):
        order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
        for config in order:
            for fn, into in ((runs[config], seconds), (short_runs[config], short_seconds)):
                gc.collect()
                start, start_cpu = time.perf_counter(), time.process_time()
                with torch.inference_mode():
                    fn()
                into[config].append(time.perf_counter() - start)
                if into is seconds:
                    cpu[config].append(time.process_time() - start_cpu)
    return {"seconds": seconds, "cpu": cpu, "short_seconds": short_seconds, "short": short, "tokens": tokens}


def counts_worker(model_name: str, new: int, batch: int) -> dict:
    """Per generated token, for each configuration of the hf group: aten ops, host reads, Python calls."""
    import torch

    short = max(1, new // 4)
    with torch.inference_mode():
        return {
            c: common.per_token_counts(lambda n, c=c: make_run(c, model_name, n, batch), short, new)
            for c in GROUPS["hf"]
        }


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 4:
        return min(values), max(values)
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--group", default=None, help="run one group in this process (worker)")
    parser.add_argument("--model", default="small", choices=sorted(MODELS))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default=None, help="comma-separated groups (hf, nnsight, tl3)")
    parser.add_argument("--new", type=int, default=None, help="new tokens per run")
    parser.add_argument("--rounds", type=int, default=None, help="fresh processes per group")
    parser.add_argument(
        "--reps", type=int, default=None, help="repetitions of each configuration per process"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads per process")
    parser.add_argument("--batch", type=int, default=BATCH, help="prompts per generate call")
    parser.add_argument("--counts", action="store_true", help=argparse.SUPPRESS)  # (worker)
    args = parser.parse_args()
    settings = SETTINGS["quick" if args.quick else "full"]
    new, rounds, reps = (
        args.new or settings["new"],
        args.rounds or settings["rounds"],
        args.reps or settings["reps"],
    )
    if args.group or args.counts:
        common.setup_process()
        import torch

        torch.set_num_threads(args.threads)
        common.emit(
            counts_worker(args.model, new, args.batch)
            if args.counts
            else worker(args.group, args.model, new, reps, args.batch)
        )
        return
    common.run_fresh(sys.executable, common.BENCH_DIR / "core_cases.py", ["prepare"])
    groups = args.only.split(",") if args.only else list(GROUPS)
    started = time.time()
    # per configuration: its runs' ms/token, and its ratio to the plain-generate run of the same
    # repetition in the same process
    ms: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    step_ratios: dict[str, list[float]] = {}  # per extra token: (t_new - t_short) over plain generate's
    cpu_ratios: dict[str, list[float]] = {}  # the same pairs in process CPU time (1 thread: the work done)
    tokens: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    loads: list[str] = []
    for _ in range(rounds):
        for group in groups:  # groups alternate, process after process
            loads.append(open("/proc/loadavg").read().split()[0])
            out = common.run_fresh(
                sys.executable,
                Path(__file__),
                [
                    "--group",
                    group,
                    "--model",
                    args.model,
                    "--new",
                    str(new),
                    "--reps",
                    str(reps),
                    "--threads",
                    str(args.threads),
                    "--batch",
                    str(args.batch),
                ],
                env={"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)},
            )
            if "error" in out:
                errors[group] = out["error"]
                continue
            base, base_cpu = out["seconds"]["hf"], out["cpu"]["hf"]
            base_step = [a - b for a, b in zip(base, out["short_seconds"]["hf"], strict=True)]
            for config, secs in out["seconds"].items():
                steps = [a - b for a, b in zip(secs, out["short_seconds"][config], strict=True)]
                step_ratios.setdefault(config, []).extend(
                    s / b for s, b in zip(steps, base_step, strict=True)
                )
                ms.setdefault(config, []).extend(s / new * 1e3 for s in secs)
                ratios.setdefault(config, []).extend(s / b for s, b in zip(secs, base, strict=True))
                cpu_ratios.setdefault(config, []).extend(
                    s / b for s, b in zip(out["cpu"][config], base_cpu, strict=True)
                )
                tokens.setdefault(config, out["tokens"][config])
            # after every process: a stopped run keeps what it measured
            _save(args, new, rounds, reps, loads, ms, ratios, cpu_ratios, errors, step_ratios)
    loads.append(open("/proc/loadavg").read().split()[0])
    counts = common.run_fresh(
        sys.executable,
        Path(__file__),
        [
            "--counts",
            "--model",
            args.model,
            "--new",
            str(new),
            "--batch",
            str(args.batch),
            "--threads",
            str(args.threads),
        ],
    )
    loads.append(open("/proc/loadavg").read().split()[0])
    print(
        f"model {args.model}, batch {args.batch}, prompt {PROMPT}, {new} new greedy tokens; {rounds} "
        f"process(es) per group x {reps} paired repetitions, {args.threads} thread(s); "
        f"{time.time() - started:.0f} s; 1-min load between "
        f"processes {min(loads, key=float)}-{max(loads, key=float)}"
    )
    print(
        f"{'config':<16} {'ms/token':>9} {'(range)':>15}  {'x hf (paired)':>13}  {'ratio range':>13}  "
        f"{'ratio IQR':>11}  {'CPU x hf':>8}  {'CPU IQR':>11}  {'per extra token':>15}  {'IQR':>11}  "
        f"{'ops/token':>11}  {'host reads':>10}  {'py calls':>11}"
    )
    plain_counts = counts.get("hf", {})

    def counted(config: str, key: str) -> str:
        c = counts.get(config)
        if not c or not plain_counts:
            return "-"
        return f"{c[key]:.0f}" if config == "hf" else f"+{c[key] - plain_counts[key]:.1f}"

    for config in [c for g in groups for c in GROUPS[g] if c != "hf" or g == groups[0]]:
        if config not in ms:
            continue
        m, r = ms[config], ratios[config]
        low_q, high_q = _quartiles(r)
        c = cpu_ratios[config]
        low_c, high_c = _quartiles(c)
        st = step_ratios[config]
        low_s, high_s = _quartiles(st)
        print(
            f"{config:<16} {statistics.median(m):9.2f} {min(m):7.2f}-{max(m):<7.2f}  "
            f"{statistics.median(r):13.3f}  {min(r):6.3f}-{max(r):<6.3f}  {low_q:5.3f}-{high_q:<5.3f}  "
            f"{statistics.median(c):8.3f}  {low_c:5.3f}-{high_c:<5.3f}  {statistics.median(st):15.3f}  "
            f"{low_s:5.3f}-{high_s:<5.3f}  {counted(config, 'ops'):>11}  "
            f"{counted(config, 'host_reads'):>10}  {counted(config, 'python_calls'):>11}"
        )
    for group, error in errors.items():
        print(f"group {group}: error: {error[:300]}")
    if "error" in counts:
        print(f"counts: error: {counts['error'][:300]}")
    steered = {c: t for c, t in tokens.items() if c.endswith("steer") and t}
    if len(set(map(tuple, steered.values()))) > 1:
        print(
            "note: steered tokens differ between tools:",
            {c: t[PROMPT : PROMPT + 6] for c, t in steered.items()},
        )
    elif steered:
        print(f"steered tokens agree across {', '.join(steered)}")
    plain = {
        c: t
        for c, t in tokens.items()
        if c in ("hf", "hs_capture", "hand_capture", "tl3_plain", "tl3_capture") and t
    }
    if len(set(map(tuple, plain.values()))) > 1:
        print("note: unsteered tokens differ:", {c: t[PROMPT : PROMPT + 6] for c, t in plain.items()})
    _save(
        args,
        new,
        rounds,
        reps,
        loads,
        ms,
        ratios,
        cpu_ratios,
        errors,
        step_ratios,
        counts,
        versions=common.run_fresh(sys.executable, common.BENCH_DIR / "core_cases.py", ["versions"]),
    )


def _save(
    args, new, rounds, reps, loads, ms, ratios, cpu_ratios, errors, step_ratios, counts=None, versions=None
) -> None:
    out_dir = common.OUT_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "model": args.model,
        "new": new,
        "rounds": rounds,
        "reps": reps,
        "threads": args.threads,
        "batch": args.batch,
        "loads": loads,
        "ms_per_token": ms,
        "paired_ratio": ratios,
        "paired_cpu_ratio": cpu_ratios,
        "paired_step_ratio": step_ratios,
        "per_token_counts": counts,
        "errors": errors,
        "versions": versions,
    }
    (out_dir / f"generate-{args.model}-latest.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
