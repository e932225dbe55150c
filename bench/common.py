"""Shared pieces of the benchmarks: the cached models, inputs, timers, peak-memory probes and the
fresh-process runner.

Every configuration runs in its own process (`run_fresh`), so one configuration's caches,
allocator state and imports never flatter or penalise the next. Each process loads the same
weights from `bench/out/` (built once, seeded), so hookscope, TransformerLens and nnsight all
see one model.
"""

from __future__ import annotations

import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
OUT_DIR = BENCH_DIR / "out"
GPT2_SMALL_DIR = OUT_DIR / "gpt2-small-random"
TINY_DIR = OUT_DIR / "gpt2-tiny-random"
SEED = 0
THREADS = 2
BATCH, SEQ = 8, 128

# Memory is measured in its own process with a fixed mmap threshold: glibc otherwise keeps freed
# mid-sized buffers in its heap after the first pass, and later passes would look free.
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


# --- models and inputs ---------------------------------------------------------------------


def ensure_models() -> None:
    """Build the random GPT-2-small-shaped model and the tiny GPT-2 once, with a fixed seed."""
    import torch

    from hookscope.testing import gpt2_small_config, save_tiny, train_tokenizer

    if not (GPT2_SMALL_DIR / "ready").exists():
        from transformers import GPT2LMHeadModel

        torch.manual_seed(SEED)
        model = GPT2LMHeadModel(gpt2_small_config()).eval()
        model.save_pretrained(GPT2_SMALL_DIR)
        train_tokenizer().save_pretrained(GPT2_SMALL_DIR)
        (GPT2_SMALL_DIR / "ready").write_text("ok\n")
    if not (TINY_DIR / "ready").exists():
        save_tiny("gpt2", TINY_DIR, seed=SEED)
        (TINY_DIR / "ready").write_text("ok\n")


def setup_process() -> None:
    """What every benchmark process does first: 2 threads, quiet libraries."""
    import torch

    torch.set_num_threads(THREADS)
    import transformers

    transformers.logging.set_verbosity_error()


def load_hf(path: Path = GPT2_SMALL_DIR):
    """The saved model as Hugging Face loads it (its default attention kernel), in eval mode."""
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel.from_pretrained(path).eval()


def tl3_config(hf_config):
    """A HookedTransformerConfig with the shape of a Hugging Face GPT-2 config (no hub access)."""
    from transformer_lens import HookedTransformerConfig

    return HookedTransformerConfig(
        n_layers=hf_config.n_layer,
        d_model=hf_config.n_embd,
        n_heads=hf_config.n_head,
        d_head=hf_config.n_embd // hf_config.n_head,
        d_mlp=4 * hf_config.n_embd,
        d_vocab=hf_config.vocab_size,
        n_ctx=hf_config.n_positions,
        act_fn="gelu_new",
        normalization_type="LN",
        eps=hf_config.layer_norm_epsilon,
        original_architecture="GPT2LMHeadModel",
        positional_embedding_type="standard",
        default_prepend_bos=False,
        device="cpu",
    )


def load_tl3(path: Path = GPT2_SMALL_DIR):
    """TransformerLens 3.x HookedTransformer holding the same weights, unprocessed (no LN folding),
    so its activations equal the Hugging Face model's."""
    from transformer_lens import HookedTransformer
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

    hf = load_hf(path)
    cfg = tl3_config(hf.config)
    model = HookedTransformer(cfg)
    state = convert_gpt2_weights(hf, cfg)
    model.load_and_process_state_dict(
        state,
        fold_ln=False,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=False,
    )
    del hf, state
    gc.collect()
    return model.eval()


def load_tl4(path: Path = GPT2_SMALL_DIR):
    """TransformerLens 4.x TransformerBridge over the saved model, booted offline from the
    directory with the model and tokenizer passed in."""
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoTokenizer

    hf = load_hf(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    bridge = TransformerBridge.boot_transformers(str(path), hf_model=hf, tokenizer=tokenizer, device="cpu")
    return bridge.eval()


def input_ids(vocab_size: int, batch: int = BATCH, seq: int = SEQ, seed: int = SEED):
    """Random token ids, the same in every process."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=generator)


# --- timing ----------------------------------------------------------------------------------


def time_runs(fn: Callable[[], Any], runs: int, warmup: int = 1) -> list[float]:
    """Wall seconds of `runs` calls of `fn`, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        gc.collect()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def per_op_us(op: Callable[[], Any], batches: int, budget_s: float, max_reps: int = 2000) -> list[float]:
    """Microseconds per call of a fast operation: `batches` timed batches, each repeating `op`
    as often as fits in `budget_s` (at least once), after warm-up / calibration calls."""
    calls = []
    for _ in range(3):
        start = time.perf_counter()
        op()
        calls.append(time.perf_counter() - start)
    reps = max(1, min(max_reps, int(budget_s / max(min(calls), 1e-7))))
    result = []
    for _ in range(batches):
        gc.collect()
        start = time.perf_counter()
        for _ in range(reps):
            op()
        result.append((time.perf_counter() - start) / reps * 1e6)
    return result


def median(values: list[float]) -> float:
    return statistics.median(values)


# --- memory ----------------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+)", f.read(), re.MULTILINE).group(1))


def rss_bytes() -> tuple[int, int]:
    """This process's resident set now and its high-water mark (VmRSS, VmHWM), in bytes."""
    return _status_kib("VmRSS") * 1024, _status_kib("VmHWM") * 1024


def reset_rss_peak() -> None:
    """Reset this process's resident-set high-water mark to its current size (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_extra_rss(fn: Callable[[], Any]) -> int:
    """Bytes by which the resident set's high-water mark rose above its level at the start
    during one call of `fn` (Linux: the mark is reset through /proc/self/clear_refs)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    result = fn()
    peak = _status_kib("VmHWM")
    del result
    return (peak - before) * 1024


# --- fresh processes -------------------------------------------------------------------------


def source_env(tree: str | Path) -> dict[str, str]:
    """Environment for a child that must import hookscope from `tree`/src (another checkout, e.g.
    the code before a change) ahead of the installed one."""
    src = str(Path(tree).resolve() / "src")
    rest = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": src + (os.pathsep + rest if rest else "")}


def use_source(tree: str | Path) -> None:
    """Import hookscope from `tree`/src in this process and every child it starts (`--src`)."""
    if not (Path(tree) / "src" / "hookscope").is_dir():
        raise SystemExit(f"--src {tree}: no src/hookscope there")
    os.environ.update(source_env(tree))
    sys.path.insert(0, str(Path(tree).resolve() / "src"))


def run_fresh(
    python: str, script: Path, args: list[str], env: dict[str, str] | None = None, timeout: float = 1800
) -> dict:
    """Run `python script args` in a new process; its last stdout line is a JSON object."""
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": str(THREADS),
        "MKL_NUM_THREADS": str(THREADS),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **(env or {}),
    }
    proc = subprocess.run(
        [python, str(script), *args],
        check=False,
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=REPO_DIR,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
    return json.loads(lines[-1])


def emit(result: dict) -> None:
    """A worker's answer to `run_fresh`: one JSON line on stdout."""
    print(json.dumps(result), flush=True)
    sys.stdout.flush()


# --- what a generated token costs, counted ----------------------------------------------------

# aten ops that read a tensor's value on the host: on a GPU each waits for the device to finish
HOST_READS = ("aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero", "aten::item")
# CUDA runtime calls that block the host (a pageable copy, an explicit synchronize)
CUDA_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def per_token_counts(run_for: Callable[[int], Callable[[], Any]], short: int, long: int) -> dict:
    """What one more generated token costs a configuration: aten ops, host reads of a tensor's value
    (`HOST_READS`, plus the blocking CUDA runtime calls where the profiler sees a GPU) and Python
    calls, each counted over a run of `long` and one of `short` new tokens, divided by the difference
    (so what a run does once, setting up or finishing, cancels). `run_for(n)`: a call generating n."""
    import cProfile
    import pstats

    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    counts: dict[int, dict] = {}
    for n in (short, long):
        fn = run_for(n)
        fn()  # warm
        with torch.profiler.profile(activities=activities) as prof:
            fn()
        names = [e.name for e in prof.events()]
        profiler = cProfile.Profile()
        profiler.enable()
        fn()
        profiler.disable()
        counts[n] = {
            "ops": sum(name.startswith("aten::") for name in names),
            "host_reads": sum(name in HOST_READS for name in names),
            "cuda_waits": sum(
                name.startswith(CUDA_WAITS) and not name.startswith("cudaMemcpyAsync") for name in names
            ),
            "python_calls": pstats.Stats(profiler).total_calls,
        }
    return {key: (counts[long][key] - counts[short][key]) / (long - short) for key in counts[long]}
