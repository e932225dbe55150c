"""One configuration of the extraction benchmark, run in the current (fresh) process.

    python bench/extract_cases.py CASE --tokens 16384 --shard-rows 8192 --out DIR

prints one JSON line: the steady-state interval (from the end of the first batch to the end of
the last, disk included) and its tokens; the in-process time to the end of the first batch (imports,
model load, tokenizing, first batch) and in all; the peak RSS of the whole process and of the
steady state alone. Cases:
  floor     the truncated forward alone: embeddings + blocks 0-6 by hand (core_cases.floor_blocks)
            over the same packed batches, all packed before the first one runs; the result is discarded
  extract   `hookscope extract` of blocks.6.resid_post to float16: the CLI's own main() in this
            process, with the store writer wrapped only to timestamp each batch
  tl3       TransformerLens 3.9 `run_with_cache(names_filter=...)` + `torch.save` of the float16
            activation, per batch, over the same packed batches
  tl3_stop  the same with `stop_at_layer=7` (what a user who knows the option writes)
  check     the three ways give the same activations (run once, before timing)
  minilm    `hookscope extract` of the bundled MiniLM at `--points` (before_after.py's extraction
            case; its clock counts rows stored, not tokens; `--keep` leaves the store for a byte
            comparison)
bench_extract.py runs them side by side; this file only knows how to run one.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from core_cases import floor_blocks, versions

POINT, TL_POINT, LAYER = "blocks.6.resid_post", "blocks.6.hook_resid_post", 6
DATA, CONTEXT, BATCH, DTYPE = "builtin:stdlib-docstrings", 128, 8, "float16"


class Clock:
    """Marks the end of each batch; the steady state runs from the first mark to `stop()`. At the
    first mark the RSS high-water mark is read and reset, so the peak of the steady state (the
    streaming, which must stay flat) is seen apart from the start-up's (loading the weights)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.marks: list[tuple[float, int]] = []  # (time, tokens of the batch just finished)
        self.stopped: float | None = None
        self.startup_rss: tuple[int, int] = (0, 0)
        self.cpu: list[float] = []  # process CPU seconds (all threads) at the first mark and at stop()

    def mark(self, tokens: int) -> None:
        self.marks.append((time.perf_counter(), tokens))
        if len(self.marks) == 1:
            self.cpu.append(time.process_time())
            self.startup_rss = common.rss_bytes()
            common.reset_rss_peak()

    def stop(self) -> None:
        if self.stopped is None:
            self.stopped = time.perf_counter()
            self.cpu.append(time.process_time())

    def result(self) -> dict:
        first = self.marks[0][0]
        rss_end, steady_peak = common.rss_bytes()
        return {
            "batches": len(self.marks),
            "tokens": sum(t for _, t in self.marks),
            "steady_tokens": sum(t for _, t in self.marks[1:]),
            "steady_s": self.stopped - first,
            "steady_cpu_s": self.cpu[1] - self.cpu[0],
            "first_batch_s": first - self.started,
            "total_s": self.stopped - self.started,
            "peak_rss_bytes": max(self.startup_rss[1], steady_peak),
            "steady_peak_rss_bytes": steady_peak,
            "rss_first_batch_bytes": self.startup_rss[0],
            "rss_end_bytes": rss_end,
        }


def packed_batches(tokens: int) -> list[dict]:
    """The batches `hookscope extract` runs on, built the same way (data.pack + data.batches)."""
    from transformers import AutoTokenizer

    from hookscope.sources import batches, iter_documents, pack

    tokenizer = AutoTokenizer.from_pretrained(common.GPT2_SMALL_DIR)
    sequences = pack(iter_documents(DATA), tokenizer, context=CONTEXT, max_tokens=tokens)
    return list(batches(sequences, BATCH))


def extract_argv(tokens: int, shard_rows: int, out: Path) -> list[str]:
    return [
        "extract",
        str(common.GPT2_SMALL_DIR),
        "--out",
        str(out),
        "--points",
        POINT,
        "--data",
        DATA,
        "--context",
        str(CONTEXT),
        "--batch-size",
        str(BATCH),
        "--dtype",
        DTYPE,
        "--max-tokens",
        str(tokens),
        "--shard-rows",
        str(shard_rows),
        "--no-progress",
    ]


# --- the configurations ----------------------------------------------------------------------


def run_floor(clock: Clock, tokens: int) -> None:
    import torch

    model = common.load_hf()
    prepared = packed_batches(tokens)
    with torch.inference_mode():
        for batch in prepared:
            floor_blocks(model, batch["input_ids"], last=LAYER)
            clock.mark(batch["input_ids"].numel())
    clock.stop()


def run_extract(clock: Clock, tokens: int, shard_rows: int, out: Path) -> None:
    def tokens_of(tensors, meta) -> int:
        return int(meta["seq_ids"].unique().numel()) * CONTEXT

    timed_extract(clock, extract_argv(tokens, shard_rows, out), tokens_of)


def run_minilm(clock: Clock, points: str, tokens: int, shard_rows: int, out: Path) -> None:
    """The bundled MiniLM's `points` to float16; the clock counts the rows stored (BOS, CLS and SEP
    dropped), what a reader of the store gets."""

    def rows_of(tensors, meta) -> int:
        return len(next(iter(tensors.values())))

    argv = extract_argv(tokens, shard_rows, out)
    argv[1:2] = []  # no MODEL: the bundled default
    argv[argv.index("--points") + 1] = points
    timed_extract(clock, argv, rows_of)


def timed_extract(clock: Clock, argv: list[str], counted: Callable[[Any, Any], int]) -> None:
    """`hookscope extract`: the CLI's own main() in this process, its store writer wrapped only to
    mark each batch (`counted(tensors, meta)`: the tokens or rows it holds) and the end of close()."""
    from hookscope.cli import main
    from hookscope.extract import loop  # `hookscope.extract` itself reads as the function hs.extract
    from hookscope.store import ShardWriter

    class TimedWriter(ShardWriter):
        """The store writer, unchanged, with a timestamp when each computed batch is handed over
        and when close() has flushed and committed everything."""

        def write(self, batch_index, tensors, meta=None, **options):  # (the loop's `handoff=`)
            clock.mark(counted(tensors, meta))
            super().write(batch_index, tensors, meta, **options)

        def close(self) -> None:
            super().close()
            clock.stop()

    loop.ShardWriter = TimedWriter
    if main(argv) != 0:
        raise SystemExit("hookscope extract failed")


def run_tl3(clock: Clock, tokens: int, out: Path, stop: bool) -> None:
    import torch

    model = common.load_tl3()
    prepared = packed_batches(tokens)
    out.mkdir(parents=True)
    options = {"names_filter": TL_POINT, **({"stop_at_layer": LAYER + 1} if stop else {})}
    with torch.inference_mode():
        for i, batch in enumerate(prepared):
            _, cache = model.run_with_cache(batch["input_ids"], **options)
            torch.save(cache[TL_POINT].half(), out / f"batch-{i:05d}.pt")
            clock.mark(batch["input_ids"].numel())
    clock.stop()


def run_check(out: Path) -> dict:
    """Two batches through each way: the store's rows (BOS dropped) equal the floor's activations
    at the kept tokens, and TransformerLens' saved tensors equal the floor's, in float16."""
    import torch

    import hookscope as hs

    prepared = packed_batches(2 * BATCH * CONTEXT)
    model = common.load_hf()
    with torch.inference_mode():
        floor = [floor_blocks(model, b["input_ids"], last=LAYER) for b in prepared]
    keep = [b["attention_mask"].bool() & ~b["special_mask"].bool() for b in prepared]
    reference = torch.cat([f[k] for f, k in zip(floor, keep, strict=True)]).to(torch.float16)

    clock = Clock()
    run_extract(clock, 2 * BATCH * CONTEXT, 1024, out / "store")
    store = hs.open_store(out / "store", verify=True)
    kept_ids = torch.cat([b["input_ids"][k] for b, k in zip(prepared, keep, strict=True)])
    assert torch.equal(store.tensor("token_ids"), kept_ids)
    extract_diff = (store.tensor(POINT).float() - reference.float()).abs().max().item()

    run_tl3(Clock(), 2 * BATCH * CONTEXT, out / "tl3", stop=True)
    saved = torch.cat([torch.load(p) for p in sorted((out / "tl3").glob("*.pt"))])
    tl3_diff = (saved.float() - torch.cat(floor).to(torch.float16).float()).abs().max().item()
    scale = reference.float().abs().max().item()
    for name, diff in (("extract", extract_diff), ("tl3_stop", tl3_diff)):
        assert diff <= 2e-3 * scale, f"{name} differs from the floor by {diff} (values up to {scale})"
    return {
        "rows": len(store),
        "max_abs_value": scale,
        "max_abs_diff_vs_floor": {"extract": extract_diff, "tl3_stop": tl3_diff},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("case")
    parser.add_argument("--tokens", type=int, default=16384, help="--max-tokens of the run")
    parser.add_argument("--shard-rows", type=int, default=8192)
    parser.add_argument(
        "--out", type=Path, help="scratch directory for the files written (deleted after unless --keep)"
    )
    parser.add_argument("--points", default=POINT, help="minilm: the points extracted")
    parser.add_argument(
        "--keep", action="store_true", help="keep --out (the store), e.g. to compare its bytes"
    )
    args = parser.parse_args()
    clock = Clock()
    common.setup_process()
    if args.case in ("versions", "prepare"):
        if args.case == "prepare":
            common.ensure_models()
        common.emit(versions())
        return
    if args.out is None or args.out.exists():
        raise SystemExit("--out must name a directory that does not exist yet")
    try:
        if args.case == "check":
            common.emit(run_check(args.out))
            return
        if args.case == "floor":
            run_floor(clock, args.tokens)
        elif args.case == "extract":
            run_extract(clock, args.tokens, args.shard_rows, args.out)
        elif args.case == "minilm":
            run_minilm(clock, args.points, args.tokens, args.shard_rows, args.out)
        elif args.case in ("tl3", "tl3_stop"):
            run_tl3(clock, args.tokens, args.out, stop=args.case == "tl3_stop")
        else:
            raise SystemExit(f"unknown case {args.case!r}")
        result = clock.result()
        if args.out.exists():
            files = [p for p in args.out.rglob("*") if p.is_file()]
            result["disk_bytes"] = sum(p.stat().st_size for p in files)
            result["shards"] = sum(p.suffix == ".safetensors" for p in files)
        common.emit(result)
    finally:
        if not args.keep:
            shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    main()
