"""Tensor parallelism on the CPU (issue 49): a capture on a TP=2 model (two torchrun ranks, gloo)
beside the TP=2 forward alone in the same processes, and each rank's peak memory beside one
unsharded process's; then, in the same TP=2 processes, `hs.extract(tp=2)` of the builtin corpus
(EXTRACT_POINTS, 4 x 128-token batches, float16 rows) beside the TP=2 forward alone, in tokens/s.

    .venv/bin/python bench/bench_tp.py            # ~2 min on 2 cores: builds bench/out/tp-llama once
    .venv/bin/python bench/bench_tp.py --memory [BLOCKS]   # peak memory alone, weights dominating
    .venv/bin/python bench/bench_tp.py --memory-points [BLOCKS]   # the same, loads for blocks.1's points

The model: a random Llama (d_model 1024, 8 layers, 16 heads, 8 kv heads, d_mlp 4096, vocab 8192,
~150 M parameters, float32, ~600 MB). Inputs: 4 x 128 tokens. The capture keeps every block's
`attn.z` and `mlp.post` (sharded: gathered) and `resid_post` (whole), and runs the model to the end,
like the forward it is compared with; the same capture with `positions="last"` beside it (on the TP
ranks only the last rows are gathered). One process runs with 2 threads; each TP rank with 1 (2
cores either way). Peak memory is VmHWM from /proc/self/status, after the imports and at the end
(before the extraction, which loads a model of its own). The extraction's rate is its rows (tokens)
over its own time (first batch to last commit); the forward's, 512 tokens over its median time,
taken before and after the extraction.

`--memory`: where the weights dominate (the bench_big.py shape with BLOCKS blocks, 32 by default:
d_model 1024, d_mlp 2816, 16 heads, vocab 32000, float32, 1.9 GB at 32 blocks, 2.7 GB at 48,
built once in bench/out/tp-llama-<BLOCKS>b), each
process loads the model and runs one forward of 1 x 32 tokens: one unsharded `hs.load`, `hs.load(
tp=2)`, and transformers' own `from_pretrained(tp_plan="auto")` (its memory map) beside them.

`--memory-points`: the same shape (16 blocks by default, 1.1 GB), loaded for a capture of
`blocks.1.resid_post` (the first 2 blocks): `hs.load(tp=2, points=[...])` and one process's
`hs.load(points=[...])`, each then collecting that point from 1 x 32 tokens (the pass stopped after
block 1), beside `hs.load(tp=2)` and its one forward, as `--memory` runs it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
MODEL = BENCH / "out" / "tp-llama"
POINTS = ["blocks.*.attn.z", "blocks.*.mlp.post", "blocks.*.resid_post"]
REPEATS = 5
# the extraction: one attention and one MLP point, and the last block's output (the whole model runs)
EXTRACT_POINTS = ["blocks.3.attn.z", "blocks.3.mlp.post", "blocks.7.resid_post"]
EXTRACT_TOKENS = 16 * 512


def build() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(MODEL)


def add_tokenizer() -> None:
    """The extraction reads text: a small trained tokenizer (ids below the model's vocabulary)."""
    from hookscope.testing import train_tokenizer

    train_tokenizer(4096).save_pretrained(MODEL)


def status_mib(key: str = "VmHWM") -> float:
    text = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith(key + ":"))) / 1024


def pss_mib() -> float:
    """Proportional set size now: a page shared by k processes counts 1/k (the checkpoint's page-cache
    pages both ranks map, which each rank's RSS counts whole)."""
    text = Path("/proc/self/smaps_rollup").read_text()
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith("Pss:"))) / 1024


def vmhwm_mib() -> float:
    return status_mib("VmHWM")


def worker(tp: int) -> None:
    import torch

    import hookscope as hs

    torch.set_num_threads(2 // tp)
    after_imports, after_imports_pss = vmhwm_mib(), pss_mib()
    loaded = hs.load(str(MODEL), tokenizer=False, dtype=torch.float32, **({"tp": tp} if tp > 1 else {}))
    model = loaded.model
    ids = torch.randint(0, 8192, (4, 128), generator=torch.Generator().manual_seed(0))

    def forward() -> None:
        with torch.inference_mode():
            model(ids)

    def capture() -> None:
        with hs.capture(model, POINTS) as cap, torch.inference_mode():
            model(ids)
        assert cap["blocks.7.attn.z"].shape == (4, 128, 16, 64)

    def capture_last() -> None:
        with hs.capture(model, POINTS, positions="last") as cap, torch.inference_mode():
            model(ids)
        assert cap["blocks.7.attn.z"].shape == (4, 16, 64)

    runs = {"forward": forward, "capture": capture, "capture_last": capture_last}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():  # warm-up
        fn()
    for _ in range(REPEATS):  # interleaved: a slow moment of the machine hits each
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    result = {
        "tp": tp,
        "rank": int(os.environ.get("RANK", 0)),
        "forward_s": statistics.median(times["forward"]),
        "capture_s": statistics.median(times["capture"]),
        "capture_last_s": statistics.median(times["capture_last"]),
        "vmhwm_after_imports_mib": after_imports,
        "vmhwm_mib": vmhwm_mib(),
        # the weights: an unsharded load maps the checkpoint (file pages, shared with the page cache);
        # a TP rank copies its shards into private memory, and the pages it read stay mapped
        "rss_anon_mib": status_mib("RssAnon"),
        "rss_file_mib": status_mib("RssFile"),
        "pss_mib": pss_mib(),
        "pss_after_imports_mib": after_imports_pss,
    }
    if tp > 1:
        result.update(extraction(tp, forward))
    print("RESULT " + json.dumps(result), flush=True)


def extraction(tp: int, forward) -> dict:
    """`hs.extract(tp=tp)` of EXTRACT_TOKENS tokens, and the forward alone before and after it."""
    import shutil

    import torch.distributed as dist

    from hookscope.extract import ExtractConfig, extract

    def forward_s() -> list[float]:
        times = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            forward()
            times.append(time.perf_counter() - start)
        return times

    before = forward_s()
    out = BENCH / "out" / f"tp-extract-{os.environ['MASTER_PORT']}"  # the same on every rank
    cfg = ExtractConfig(
        out=str(out),
        model=str(MODEL),
        points=EXTRACT_POINTS,
        context=128,
        batch_size=4,
        max_tokens=EXTRACT_TOKENS,
        progress=False,
        tp=tp,
    )
    summary = extract(cfg)
    after = forward_s()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(out)
    return {
        "forward_tokens_s": 4 * 128 / statistics.median(before + after),
        "extract_tokens_s": summary.new_rows / summary.seconds if summary.wrote else None,
        "extract_rows": summary.new_rows,
    }


def run(tp: int, args: list[str] | None = None) -> list[dict]:
    script = [str(Path(__file__).resolve()), *(args or ["--worker", str(tp)])]
    if tp == 1:
        command = [sys.executable, *script]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(tp), *script]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    found = [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not found:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-4000:])
    return found


def big(blocks: int) -> Path:
    return BENCH / "out" / f"tp-llama-{blocks}b"


LOADS = {"unsharded": 1, "hs-tp": 2, "transformers-tp": 2}  # how each process loads, its ranks
POINTS_LOADS = {"hs-tp": 2, "hs-tp-points": 2, "hs-points": 1}  # --memory-points
MEMORY_POINT = "blocks.1.resid_post"


def build_big(blocks: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=16)
    config = LlamaConfig(
        **shape,
        num_hidden_layers=blocks,
        vocab_size=32000,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.no_grad():
        LlamaForCausalLM(config).save_pretrained(big(blocks))


def memory_worker(how: str, blocks: int) -> None:
    import torch

    import hookscope as hs

    torch.set_num_threads(1)
    after_imports = vmhwm_mib()
    if how == "transformers-tp":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(big(blocks), tp_plan="auto", dtype=torch.float32)
    else:
        options = {"tp": 2} if how.startswith("hs-tp") else {}
        if how.endswith("-points"):
            options["points"] = [MEMORY_POINT]
        model = hs.load(str(big(blocks)), tokenizer=False, dtype=torch.float32, **options).model
    loaded = vmhwm_mib()
    ids = torch.randint(0, 32000, (1, 32), generator=torch.Generator().manual_seed(0))
    if how.endswith("-points"):  # the pass stops after the point: the later blocks are not there
        hs.collect(model, ids, MEMORY_POINT)
    else:
        with torch.inference_mode():  # an unsharded load maps the file: a forward reads every page
            model(ids)
    local_parts = (p.to_local() if hasattr(p, "to_local") else p for p in model.parameters())
    local = sum(p.nbytes for p in local_parts if not p.is_meta)  # (points=: the rest stays on meta)
    row = {"how": how, "rank": int(os.environ.get("RANK", 0)), "imports_mib": after_imports}
    row |= {"loaded_mib": loaded, "vmhwm_mib": vmhwm_mib(), "weights_mib": local / 2**20}
    row |= {"rss_anon_mib": status_mib("RssAnon"), "rss_file_mib": status_mib("RssFile")}
    print("RESULT " + json.dumps(row), flush=True)


def memory(blocks: int, loads: dict[str, int]) -> None:
    if not (big(blocks) / "config.json").exists():
        build_big(blocks)
    rows = []
    for how, ranks in loads.items():
        rows += run(ranks, ["--memory-worker", how, str(blocks)])
    one = rows[0]
    columns = ["weights_mib", "imports_mib", "loaded_mib", "vmhwm_mib", "rss_anon_mib", "rss_file_mib"]
    print(f"{'load':<22}" + "".join(f"{c.removesuffix('_mib'):>10}" for c in columns) + f"{'/ first':>12}")
    for row in rows:
        label = f"{row['how']} rank {row['rank']}"
        figures = "".join(f"{row[c]:>10.0f}" for c in columns)
        print(f"{label:<22}{figures}{row['vmhwm_mib'] / one['vmhwm_mib']:>12.2f}")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]))
        return
    if len(sys.argv) == 4 and sys.argv[1] == "--memory-worker":
        memory_worker(sys.argv[2], int(sys.argv[3]))
        return
    if sys.argv[1:2] == ["--memory"]:
        memory(int(sys.argv[2]) if len(sys.argv) > 2 else 32, LOADS)
        return
    if sys.argv[1:2] == ["--memory-points"]:
        memory(int(sys.argv[2]) if len(sys.argv) > 2 else 16, POINTS_LOADS)
        return
    if not (MODEL / "config.json").exists():
        build()
    if not (MODEL / "tokenizer.json").exists():
        add_tokenizer()
    rows = run(1) + run(2)
    one = rows[0]
    print(
        f"{'run':<14}{'forward s':>10}{'capture s':>11}{'capture/fwd':>12}{'last/fwd':>9}{'VmHWM MiB':>11}"
        f"{'imports MiB':>12}{'anon MiB':>10}{'file MiB':>10}{'PSS MiB':>9}"
    )
    for row in rows:
        label = "unsharded" if row["tp"] == 1 else f"TP=2 rank {row['rank']}"
        print(
            f"{label:<14}{row['forward_s']:>10.3f}{row['capture_s']:>11.3f}"
            f"{row['capture_s'] / row['forward_s']:>12.2f}{row['capture_last_s'] / row['forward_s']:>9.2f}"
            f"{row['vmhwm_mib']:>11.0f}"
            f"{row['vmhwm_after_imports_mib']:>12.0f}{row['rss_anon_mib']:>10.0f}{row['rss_file_mib']:>10.0f}"
            f"{row['pss_mib']:>9.0f}"
        )
    for row in rows[1:]:
        pss_share = (row["pss_mib"] - row["pss_after_imports_mib"]) / (
            one["pss_mib"] - one["pss_after_imports_mib"]
        )
        model_share = (row["vmhwm_mib"] - row["vmhwm_after_imports_mib"]) / (
            one["vmhwm_mib"] - one["vmhwm_after_imports_mib"]
        )
        print(
            f"rank {row['rank']}: peak {row['vmhwm_mib'] / one['vmhwm_mib']:.2f}x the unsharded process's "
            f"({model_share:.2f}x above the imports); PSS at the end {row['pss_mib'] / one['pss_mib']:.2f}x "
            f"({pss_share:.2f}x above the imports); TP forward {one['forward_s'] / row['forward_s']:.2f}x "
            "the unsharded forward's speed"
        )
    for row in rows[1:]:
        if row.get("extract_tokens_s"):
            print(
                f"rank {row['rank']}: extract --tp 2 {row['extract_tokens_s']:,.0f} tokens/s "
                f"({row['extract_rows']:,} rows), the TP=2 forward alone {row['forward_tokens_s']:,.0f} "
                f"tokens/s: {row['extract_tokens_s'] / row['forward_tokens_s']:.2f}x (target >= 0.9)"
            )


if __name__ == "__main__":
    main()
