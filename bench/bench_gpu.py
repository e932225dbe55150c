"""GPU figures: what hookscope costs on the device users run it on.

    python bench/bench_gpu.py --out bench/out/gpu            # on a CUDA machine (scripts/gpu-suite)
    python bench/bench_gpu.py --smoke --out /tmp/gpu-smoke   # tiny shapes on CPU: checks the script

Shapes: GPT-2-small (12 x 768) and a ~1.1B-parameter Llama-shaped config (16 x 2048, GQA 32/8),
random weights, bfloat16, batch 32 x 1024 tokens (halved until it fits). Every case runs in a fresh
process; times are medians of CUDA-synchronised wall times; memory is the peak allocated above the
model's own weights (torch.cuda.max_memory_allocated).

Cases, each against its own reference in the same process tree:
  capture      hs.collect(blocks.L.resid_post) vs the floor: a copy of the model cut after block L
               (embeddings + blocks 0..L + the final norm), run by hand
  capture_host the same capture copied to pinned host memory (device="cpu", non-blocking)
  hooks12      12 no-op hooks on the full forward vs no hooks
  extract      `extract()` tokens/s vs min(the truncated forward alone over the same packed batches,
               the disk's own fsynced write of the same bytes / bytes per token); a torch.profiler
               trace of a few extraction batches shows compute and copies overlap
  extract_all  the same with every block's resid_post (the Llama shape only: 16 points)
  compile      blocks vs full: first call in a cold process (empty inductor cache), first call in a
               warm one (the cache the cold one filled), and the steady per-call time vs eager
  generate     per-token latency of greedy generation (batch x 32-token prompt, 32 new tokens) with one
               captured point / one steering edit, hs.generate and a hand-written hook, paired with
               plain `generate` in rotated order, whole run and per extra token (32 vs 8 new), with
               aten ops, host reads and blocking CUDA calls per token (when hookscope has `hs.generate`)
  peers        TransformerLens 3.x run_with_cache(names_filter, stop_at_layer) and nnsight on the
               GPT-2 shape, when they are installed
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPES = {
    # name: (family, config overrides, layer captured)
    "gpt2-small": (
        "gpt2",
        {"d_model": 768, "n_layers": 12, "n_heads": 12, "vocab_size": 50257, "context": 1024},
        5,
    ),
    "llama-1b": (
        "llama",
        {
            "d_model": 2048,
            "n_layers": 16,
            "n_heads": 32,
            "vocab_size": 32000,
            "context": 1024,
            "intermediate_size": 5632,
            "num_key_value_heads": 8,
        },
        7,
    ),
}
SMOKE = {
    "gpt2-tiny": ("gpt2", {"d_model": 64, "n_layers": 3, "n_heads": 4, "vocab_size": 512, "context": 64}, 1)
}
CASES = (
    "capture",
    "capture_host",
    "hooks12",
    "extract",
    "extract_all",
    "compile_blocks",
    "compile_full",
    "generate",
    "peers",
)


# --- one case, in a fresh process ------------------------------------------------------------


def build(shape: tuple, device: str, dtype):
    from hookscope.testing import build_tiny

    family, overrides, layer = shape
    overrides = dict(overrides)
    vocab = overrides.pop("vocab_size")
    model = build_tiny(family, vocab_size=vocab, seed=0, **overrides).to(device, dtype)
    return model, layer


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, runs: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def peak_extra(fn, device: str) -> int | None:
    import torch

    if not device.startswith("cuda"):
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated() - base


def truncated(model, layer: int):
    """A shallow copy of the model whose block list stops after `layer` (the floor)."""
    import copy

    import torch

    base_name = "transformer" if hasattr(model, "transformer") else "model"
    base = copy.copy(getattr(model, base_name))
    attr = "h" if hasattr(base, "h") else "layers"
    setattr(base, attr, torch.nn.ModuleList(list(getattr(base, attr))[: layer + 1]))
    base.config = copy.copy(base.config)
    base.config.num_hidden_layers = layer + 1
    return base


def inputs(model, batch: int, seq: int, device: str):
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(1, model.config.vocab_size, (batch, seq), generator=g).to(device)


def case_main(args) -> dict:
    import torch

    import hookscope as hs

    torch.manual_seed(0)
    shape = (SMOKE if args.smoke else SHAPES)[args.shape]
    dtype = torch.float32 if args.smoke else torch.bfloat16
    model, layer = build(shape, args.device, dtype)
    ids = inputs(model, args.batch, args.seq, args.device)
    point = f"blocks.{layer}.resid_post"
    result: dict = {
        "case": args.case,
        "shape": args.shape,
        "batch": args.batch,
        "seq": args.seq,
        "device": args.device,
        "dtype": str(dtype),
    }

    def forward():
        with torch.inference_mode():
            return model(ids, use_cache=False).logits

    if args.case in ("capture", "capture_host"):
        floor_model = truncated(model, layer)

        def floor():
            with torch.inference_mode():
                return floor_model(ids, use_cache=False).last_hidden_state

        host = {"device": "cpu"} if args.case == "capture_host" else {}
        capture = lambda: hs.collect(model, ids, point, **host)[point]  # noqa: E731
        result["floor_s"] = timed(floor, args.device, args.runs)
        result["hookscope_s"] = timed(capture, args.device, args.runs)
        result["floor_peak"] = peak_extra(floor, args.device)
        result["hookscope_peak"] = peak_extra(capture, args.device)
    elif args.case == "hooks12":
        result["plain_s"] = timed(forward, args.device, args.runs)
        with hs.hooks(model) as h:
            for name in [f"blocks.{i}.resid_post" for i in range(model.config.num_hidden_layers)][:12]:
                h.forward(name, lambda act, hook: None)
            result["hookscope_s"] = timed(forward, args.device, args.runs)
    elif args.case in ("extract", "extract_all"):
        result.update(extract_case(model, layer, args))
    elif args.case.startswith("compile_"):
        result.update(compile_case(model, ids, point, args.case.removeprefix("compile_"), args))
    elif args.case == "generate":
        result.update(generate_case(model, ids, point, args))
    elif args.case == "peers":
        result.update(peers_case(model, ids, layer, point, args))
    return result


def extract_case(model, layer: int, args) -> dict:
    """extract() over a generated corpus vs the truncated forward over the same packed batches and
    vs the disk: the same number of bytes written raw into files of a shard's size, fsynced. The
    run is long enough (`extract_batches`) that its steady state, not its start, sets the figure;
    its timeline (bench/timeline.py) says where each stage's time went."""
    import shutil

    import torch

    from hookscope.extract import ExtractConfig, extract
    from hookscope.sources import batches, pack
    from hookscope.testing import train_tokenizer

    sys.path.insert(0, str(HERE))
    from timeline import Timeline

    every = args.case == "extract_all"
    last = model.config.num_hidden_layers - 1 if every else layer
    points = [f"blocks.{i}.resid_post" for i in range(last + 1)] if every else [f"blocks.{layer}.resid_post"]
    work = Path(tempfile.mkdtemp(prefix="hookscope-gpu-extract-"))
    try:
        model_dir = work / "model"
        model.save_pretrained(model_dir)
        tokenizer = train_tokenizer(min(model.config.vocab_size, 4096))
        tokenizer.save_pretrained(model_dir)
        n_batches = extract_batches(args, every, model.config.hidden_size)
        tokens = args.batch * args.seq * n_batches
        corpus = work / "corpus.jsonl"
        write_corpus(corpus, max(64, tokens // args.seq + 16), args.seq)
        cfg = ExtractConfig(
            out=str(work / "store"),
            model=str(model_dir),
            points=points,
            data=str(corpus),
            context=args.seq,
            batch_size=args.batch,
            dtype="bfloat16",
            device=args.device,
            max_tokens=tokens,
            progress=False,
            workers=0 if args.smoke else 4,
        )
        with Timeline() as timeline:
            summary = extract(cfg)
        extract_s = summary.seconds  # the run itself: the model's load is not in it
        shutil.rmtree(cfg.out)  # the disk holds one run's bytes at a time (the raw write's next)
        floor_model = truncated(model, last)
        # the floor's rate over the first batches (packing them here is single-threaded)
        floor_batches = min(n_batches, FLOOR_BATCHES)
        packed = list(
            batches(
                pack(
                    _jsonl(corpus),
                    tokenizer,
                    context=args.seq,
                    max_tokens=args.batch * args.seq * floor_batches,
                ),
                args.batch,
            )
        )
        try:  # the floor without transformers' check of each all-ones mask (a host sync per batch)
            from hookscope.model_inputs import unpadded
        except ImportError:  # a tree before it: the floor as it was
            unpadded = contextlib.nullcontext
        with torch.inference_mode(), unpadded():  # one batch first: the kernels loaded, cuBLAS made
            floor_model(
                input_ids=packed[0]["input_ids"].to(args.device),
                attention_mask=packed[0]["attention_mask"].to(args.device),
                use_cache=False,
            )
        sync(args.device)
        start = time.perf_counter()
        with torch.inference_mode(), unpadded():
            for b in packed:
                floor_model(
                    input_ids=b["input_ids"].to(args.device),
                    attention_mask=b["attention_mask"].to(args.device),
                    use_cache=False,
                )
        sync(args.device)
        floor_s = (time.perf_counter() - start) * n_batches / len(packed)  # at that rate, every batch
        shard_bytes = cfg.shard_rows * 2 * model.config.hidden_size
        disk_s = _raw_write_s(work, summary.bytes_written, shard_bytes)
        # the disk's own rate, no page cache (None: not taken)
        direct_s = _raw_write_s(work, summary.bytes_written, shard_bytes, direct=True)
        trace = None
        if args.trace_dir and not every:  # a few batches under the profiler: compute and copies overlap
            trace = str(Path(args.trace_dir) / f"extract-{args.shape}.json")
            small = ExtractConfig(
                **{**cfg.__dict__, "out": str(work / "traced"), "max_tokens": args.batch * args.seq * 3}
            )
            with torch.profiler.profile() as prof:
                extract(small)
            prof.export_chrome_trace(trace)
        host_reads = {} if every else _host_reads(cfg, work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = summary.new_rows
    return {
        "rows": summary.rows,
        "points": len(points),
        "batches": n_batches,
        "extract_s": extract_s,
        "floor_s": floor_s,
        "floor_batches": len(packed),
        "disk_s": disk_s,
        "direct_tok_s": rows / direct_s if direct_s else None,
        "bytes": summary.bytes_written,
        "extract_tok_s": rows / extract_s,
        "floor_tok_s": rows / floor_s,
        "disk_tok_s": rows / disk_s,
        "busy": summary.busy,
        "bound": summary.bound,
        "trace": trace,
        "timeline": timeline.summary(extract_s),
        **host_reads,
    }


FLOOR_BATCHES = 24


def extract_batches(args, every: bool, width: int) -> int:
    """Batches an extraction case runs: `--extract-batches` (ONE,ALL), else enough that the start
    (the first forward, the first pinned buffers, the first shard) is a few percent of the run, and
    the run under a minute on a disk of ~0.8 GB/s: ~11 GB for one Llama point, ~6.5 GB for GPT-2's,
    ~21 GB for every block."""
    if args.smoke:
        return 4
    if args.extract_batches:
        one, all_ = (int(x) for x in args.extract_batches.split(","))
        return all_ if every else one
    if every:
        return 10
    return 80 if width >= 2048 else 128


def write_corpus(path: Path, lines: int, seq: int) -> None:
    """`lines` JSONL documents of 2 x `seq` words (512 distinct ones, repeated: writing is quick)."""
    import torch

    words = "the residual stream of a transformer carries features between layers".split()
    g = torch.Generator().manual_seed(0)
    distinct = []
    for _ in range(min(lines, 512)):
        idx = torch.randint(0, len(words), (seq * 2,), generator=g).tolist()
        distinct.append(json.dumps({"text": " ".join(words[i] for i in idx)}) + "\n")
    with path.open("w") as f:
        for i in range(lines):
            f.write(distinct[i % len(distinct)])


def _host_reads(cfg, work: Path, args) -> dict:
    """The main thread's reads of a device tensor's value (host syncs) over 3 extraction batches,
    per batch, and where the first few were made (`HostReads`; none expected:
    tests/extract/test_host_syncs.py)."""
    try:
        from hookscope.profiling.host_reads import HostReads
    except ImportError:  # a tree before it
        return {}
    from hookscope.extract import ExtractConfig, extract

    counted = ExtractConfig(
        **{**cfg.__dict__, "out": str(work / "counted"), "max_tokens": args.batch * args.seq * 3}
    )
    with HostReads(device_only=True) as reads:
        summary = extract(counted)
    return {
        "host_reads_per_batch": len(reads.calls) / max(summary.batches_done, 1),
        "host_reads": sorted(set(reads.calls))[:4],
    }


def _raw_write_s(folder: Path, total: int, file_bytes: int, direct: bool = False) -> float | None:
    """Seconds to write `total` bytes into files of `file_bytes` in `folder`, each file fsynced
    (disk_floors.py: through the page cache, fed parts of one 64 MB buffer that end where each file
    ends; `direct`: with O_DIRECT, None where the filesystem refuses it)."""
    sys.path.insert(0, str(HERE))
    from disk_floors import direct_write_s, raw_parts, raw_write_s

    if direct:
        return direct_write_s(folder, total, file_bytes)
    return raw_write_s(folder, raw_parts(total, file_bytes), file_bytes)


def _jsonl(path: Path):
    with path.open() as f:
        for line in f:
            yield json.loads(line)["text"]


def compile_case(model, ids, point: str, policy: str, args) -> dict:
    import torch

    import hookscope as hs
    from hookscope import compiling as compile_policy

    eager_s = timed(lambda: hs.collect(model, ids, point)[point], args.device, args.runs)
    compile_policy.compile_model(model, policy)
    start = time.perf_counter()
    hs.collect(model, ids, point)
    sync(args.device)
    first_s = time.perf_counter() - start
    steady_s = timed(lambda: hs.collect(model, ids, point)[point], args.device, args.runs)
    del torch
    return {
        "eager_s": eager_s,
        "first_call_s": first_s,
        "steady_s": steady_s,
        "cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
    }


GENERATE_CONFIGS = ("plain", "hand_capture", "hs_capture", "hand_steer", "hs_steer", "hs_steer_host_vector")


def generate_runs(model, prompt, point: str, layer: int, device: str):
    """config -> (n -> a call generating n greedy tokens), as bench/bench_generate.py defines them:
    plain generate, a hand-written forward hook keeping / steering the block's output, hs.generate
    capturing / steering it; `hs_steer_host_vector`: the vector as a user may give it (float32, on
    the CPU)."""
    import torch

    import hookscope as hs

    vector = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    on_device = vector.to(device, model.dtype)
    block = model.transformer.h[layer] if hasattr(model, "transformer") else model.model.layers[layer]
    kept: list = []

    def keep(module, args, out):
        kept.append((out if isinstance(out, torch.Tensor) else out[0]).detach().clone())

    def add(module, args, out):
        return out + on_device if isinstance(out, torch.Tensor) else (out[0] + on_device, *out[1:])

    def hand(hook, n):
        def run():
            kept.clear()
            handle = block.register_forward_hook(hook)
            try:
                return model.generate(prompt, **greedy(n))
            finally:
                handle.remove()

        return run

    def greedy(n):
        return {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False}

    return {
        "plain": lambda n: lambda: model.generate(prompt, **greedy(n)),
        "hand_capture": lambda n: hand(keep, n),
        "hs_capture": lambda n: lambda: hs.generate(model, prompt, points=[point], **greedy(n)),
        "hand_steer": lambda n: hand(add, n),
        "hs_steer": lambda n: (
            lambda: hs.generate(model, prompt, edits=[hs.steer(point, on_device)], **greedy(n))
        ),
        "hs_steer_host_vector": lambda n: (
            lambda: hs.generate(model, prompt, edits=[hs.steer(point, vector)], **greedy(n))
        ),
    }


def generate_case(model, ids, point: str, args) -> dict:
    """Every configuration at NEW and at NEW / 4 tokens, in an order rotated each repetition, each
    run CUDA-synchronised and after a gc pass, so a ratio pairs runs seconds apart; then the counts
    per generated token (`common.per_token_counts`: aten ops, host reads, blocking CUDA calls,
    Python calls)."""
    import gc

    import torch

    import hookscope as hs

    if not hasattr(hs, "generate"):
        return {"skipped": "this hookscope has no hs.generate"}
    sys.path.insert(0, str(HERE))
    import common

    new = 32 if not args.smoke else 8
    short = new // 4
    layer = int(point.split(".")[1])
    runs = generate_runs(model, ids[:, :32], point, layer, args.device)
    seconds: dict[str, list[float]] = {c: [] for c in GENERATE_CONFIGS}
    short_seconds: dict[str, list[float]] = {c: [] for c in GENERATE_CONFIGS}
    calls = {c: (runs[c](new), runs[c](short)) for c in GENERATE_CONFIGS}
    for long_run, short_run in calls.values():  # warm-up
        long_run(), short_run()
    for rep in range(3 * args.runs):
        turn = rep % len(GENERATE_CONFIGS)
        order = GENERATE_CONFIGS[turn:] + GENERATE_CONFIGS[:turn]
        for config in order:
            for fn, into in zip(calls[config], (seconds, short_seconds), strict=True):
                gc.collect()
                sync(args.device)
                start = time.perf_counter()
                fn()
                sync(args.device)
                into[config].append(time.perf_counter() - start)
    with torch.inference_mode():
        counts = {c: common.per_token_counts(runs[c], short, new) for c in GENERATE_CONFIGS}
    return {"new": new, "short": short, "seconds": seconds, "short_seconds": short_seconds, "counts": counts}


def generate_figure(r: dict) -> str:
    """Paired medians against plain generate: per token of the whole run, and per extra token
    ((t_NEW - t_SHORT) / (NEW - SHORT)); the counts per token beside them."""
    secs, shorts, counts = r["seconds"], r["short_seconds"], r["counts"]
    plain, plain_step = secs["plain"], [a - b for a, b in zip(secs["plain"], shorts["plain"], strict=True)]
    c0 = counts["plain"]
    parts = [
        f"plain {median(plain) / r['new'] * 1e3:.2f} ms/token, {c0['ops']:.0f} ops, "
        f"{c0['host_reads']:.0f} host reads, {c0['cuda_waits']:.0f} CUDA waits per token"
    ]
    for config in GENERATE_CONFIGS[1:]:
        whole = median([a / b for a, b in zip(secs[config], plain, strict=True)])
        steps = [a - b for a, b in zip(secs[config], shorts[config], strict=True)]
        step = median([a / b for a, b in zip(steps, plain_step, strict=True)])
        c = counts[config]
        parts.append(
            f"{config} **{whole:.3f}x** (per extra token {step:.3f}x; "
            f"+{c['ops'] - c0['ops']:.0f} ops, "
            f"+{c['host_reads'] - c0['host_reads']:.0f} host reads, "
            f"+{c['cuda_waits'] - c0['cuda_waits']:.0f} CUDA waits, "
            f"+{c['python_calls'] - c0['python_calls']:.0f} Python calls per token)"
        )
    return "; ".join(parts)


def peers_case(model, ids, layer: int, point: str, args) -> dict:
    import torch

    out: dict = {}
    if getattr(model.config, "model_type", "") != "gpt2":
        return {"skipped": "peers run on the GPT-2 shape only"}
    try:
        from transformer_lens import HookedTransformer
        from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

        sys.path.insert(0, str(HERE))
        import common

        cfg = common.tl3_config(model.config)
        cfg.device, cfg.dtype = args.device, model.dtype
        tl = HookedTransformer(cfg)
        tl.load_and_process_state_dict(
            convert_gpt2_weights(model, cfg),
            fold_ln=False,
            center_writing_weights=False,
            center_unembed=False,
            fold_value_biases=False,
        )
        tl.to(args.device, model.dtype).eval()
        name = f"blocks.{layer}.hook_resid_post"

        def tl_run():
            with torch.inference_mode():
                return tl.run_with_cache(ids, names_filter=[name], stop_at_layer=layer + 1)[1][name]

        out["tl_stop_s"] = timed(tl_run, args.device, args.runs)
    except ImportError as e:
        out["tl_skipped"] = str(e)
    try:
        from nnsight import NNsight

        wrapped = NNsight(model)

        def nn_run():
            with torch.inference_mode(), wrapped.trace(ids, use_cache=False) as tracer:
                saved = wrapped.transformer.h[layer].output.save()
                tracer.stop()
            return saved

        out["nnsight_stop_s"] = timed(nn_run, args.device, args.runs)
    except ImportError as e:
        out["nnsight_skipped"] = str(e)
    return out


# --- the driver ---------------------------------------------------------------------------------


def run_case(case: str, shape: str, batch: int, seq: int, args, env: dict) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        case,
        "--shape",
        shape,
        "--batch",
        str(batch),
        "--seq",
        str(seq),
        "--device",
        args.device,
        "--runs",
        str(args.runs),
    ]
    if args.smoke:
        cmd.append("--smoke")
    if args.trace_dir:
        cmd += ["--trace-dir", args.trace_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-25:] or ["(no stderr)"]
        print(f"--- {shape} {case} failed:\n" + "\n".join(tail), file=sys.stderr)
        return {"case": case, "shape": shape, "error": tail[-1], "oom": "OutOfMemory" in proc.stderr}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def median(values) -> float | None:
    return statistics.median(values) if values else None


def ratio(a, b) -> str:
    a, b = median(a) if isinstance(a, list) else a, median(b) if isinstance(b, list) else b
    return f"{a / b:.3f}x" if a and b else "-"


def timeline_line(t: dict) -> str:
    sys.path.insert(0, str(HERE))
    from timeline import line

    return line(t)


def table(results: list[dict]) -> str:
    lines = ["| shape | case | batch x seq | figure |", "| --- | --- | --- | --- |"]
    for r in results:
        where = f"{r.get('batch', '?')} x {r.get('seq', '?')}"
        if "error" in r:
            fig = f"failed: {r['error']}"
        elif r["case"] in ("capture", "capture_host"):
            mem = ratio(r["hookscope_peak"], r["floor_peak"]) if r.get("floor_peak") else "-"
            ms = f"{median(r['hookscope_s']) * 1e3:.1f} vs {median(r['floor_s']) * 1e3:.1f} ms"
            fig = f"time {ratio(r['hookscope_s'], r['floor_s'])} the floor ({ms}), peak memory {mem}"
        elif r["case"] == "hooks12":
            fig = f"12 no-op hooks {ratio(r['hookscope_s'], r['plain_s'])} the plain forward"
        elif r["case"] in ("extract", "extract_all"):
            floor = min(r["floor_tok_s"], r["disk_tok_s"])
            busy = ", ".join(f"{k} {100 * v:.0f}%" for k, v in r.get("busy", {}).items())
            fig = (
                f"{r['points']} point(s): extract {r['extract_tok_s']:,.0f} tok/s vs truncated forward "
                f"{r['floor_tok_s']:,.0f}, disk {r['disk_tok_s']:,.0f} "
                f"({r['bytes'] / r['disk_s'] / 1e6:,.0f} MB/s) = **{r['extract_tok_s'] / floor:.3f}x** "
                f"the lower; busy {busy}; {r.get('bound', '')}"
                + (
                    f"; the disk with O_DIRECT {r['direct_tok_s']:,.0f} tok/s"
                    if r.get("direct_tok_s")
                    else ""
                )
                + (
                    f"; host reads {r['host_reads_per_batch']:.1f}/batch"
                    if "host_reads_per_batch" in r
                    else ""
                )
                + (
                    f"; {r.get('batches', '?')} batches; {timeline_line(r['timeline'])}"
                    if "timeline" in r
                    else ""
                )
            )
        elif r["case"].startswith("compile_"):
            fig = (
                f"{r.get('start', '')} first call {r['first_call_s']:.1f} s, steady "
                f"{ratio(r['steady_s'], r['eager_s'])} eager"
            )
        elif r["case"] == "generate":
            fig = r.get("skipped") or generate_figure(r)
        else:
            fig = ", ".join(
                f"{k} {median(v) * 1e3:.1f} ms" if isinstance(v, list) else f"{k}: {v}"
                for k, v in r.items()
                if k.endswith(("_s", "skipped"))
            )
        lines.append(f"| {r['shape']} | {r['case']} | {where} | {fig} |")
    return "\n".join(lines)


def machine(device: str) -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            info["driver"] = subprocess.run(query, capture_output=True, text=True).stdout.strip()
        except OSError:
            info["driver"] = None
    return info


def write_report(out: Path, device: str, results: list[dict]) -> str:
    """gpu.json and gpu.md after every case, so a run stopped at a time limit keeps what it measured."""
    report = {"machine": machine(device), "results": results}
    (out / "gpu.json").write_text(json.dumps(report, indent=1))
    text = f"machine: {json.dumps(report['machine'])}\n\n{table(results)}\n"
    (out / "gpu.md").write_text(text)
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(HERE / "out" / "gpu"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: check that the script runs")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--shapes", default=",".join(SHAPES), help="which of " + ", ".join(SHAPES))
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--extract-batches",
        default=None,
        help="ONE,ALL: batches of the extract and extract_all cases (default: 80 or 128 and 10)",
    )
    p.add_argument("--trace-dir", default=None, help="the extraction profiler traces' folder (default --out)")
    args = p.parse_args()
    if args.child:
        args.case = args.child
        print(json.dumps(case_main(args)))
        return
    if args.smoke:
        args.device, args.batch, args.seq, args.runs = "cpu", 2, 32, 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.trace_dir = args.trace_dir or str(out)
    Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
    results = []
    for shape in SMOKE if args.smoke else args.shapes.split(","):
        for case in args.cases.split(","):
            batch, env = args.batch, {}
            if case == "extract_all" and shape not in ("llama-1b", "gpt2-tiny"):
                continue  # the every-block case is the Llama shape's
            if case.startswith("compile_"):
                cache = tempfile.mkdtemp(prefix="inductor-")
                for start in ("cold", "warm"):  # warm: a new process on the cache the cold one filled
                    r = run_case(case, shape, batch, args.seq, args, {"TORCHINDUCTOR_CACHE_DIR": cache})
                    r["start"] = start
                    results.append(r)
                    write_report(out, args.device, results)
                continue
            while True:  # halve the batch until it fits
                r = run_case(case, shape, batch, args.seq, args, env)
                if not r.get("oom") or batch == 1:
                    break
                batch //= 2
            results.append(r)
            write_report(out, args.device, results)
            print(f"{shape} {case}: {'failed: ' + r['error'] if 'error' in r else 'done'}", file=sys.stderr)
    print(write_report(out, args.device, results))
    failed = [r for r in results if "error" in r]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
