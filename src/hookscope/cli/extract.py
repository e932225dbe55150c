"""`hookscope extract [MODEL] --out DIR`: stream points of a dataset to a sharded store."""

from __future__ import annotations

import argparse
import sys

from .args import DTYPES, at_least, model_args, points_arg, quiet_transformers


def add_parser(sub) -> None:
    from ..extract import ExtractConfig
    from ..sources import DEFAULT_CONTEXT

    default = ExtractConfig(out="")  # the one copy of the defaults: each flag shows the config's

    p = sub.add_parser("extract", help="stream chosen points of a dataset to a sharded store (resumable)")
    model_args(p)
    p.add_argument(
        "--out",
        required=True,
        help="store directory or URL (s3://, gs://, az://, hf://, memory://); "
        "re-run the same command to resume",
    )
    points_arg(
        p,
        default=default.points,
        help=f"comma-separated point names or globs (default {','.join(default.points)})",
    )
    p.add_argument(
        "--data",
        default=default.data,
        help=".txt / .jsonl file, a directory of them, a saved HF dataset dir, hf:NAME[:split], "
        f"or {default.data} (default; built offline from Python's docstrings)",
    )
    p.add_argument(
        "--text-field", default=default.text_field, help="field holding the text in .jsonl / datasets"
    )
    p.add_argument(
        "--context",
        type=int,
        default=default.context,
        help=f"tokens per packed sequence (default {DEFAULT_CONTEXT}; not for images)",
    )
    p.add_argument("--batch-size", type=int, default=default.batch_size)
    p.add_argument("--dtype", default=default.dtype, choices=DTYPES)
    p.add_argument(
        "--keep-bos",
        action="store_true",
        help="also store BOS / CLS / SEP tokens (dropped by default; images keep every token)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=default.max_tokens,
        help="stop after this many tokens (whole sequences; images: whole images)",
    )
    p.add_argument("--shard-rows", type=int, default=default.shard_rows, help="rows per shard file")
    p.add_argument(
        "--on-nonfinite",
        default=default.on_nonfinite,
        choices=["warn", "error"],
        help="NaN/Inf activations: count and report (warn), or refuse to write them (error)",
    )
    p.add_argument("--revision", default=default.revision, help="model revision (hub ids)")
    p.add_argument(
        "--device-map",
        default=default.device_map,
        help="'auto' spreads a model bigger than one device (accelerate)",
    )
    p.add_argument(
        "--max-memory",
        default=default.max_memory,
        metavar="SIZE",
        help="stream the blocks through chunks of batches, weights kept under SIZE (2GiB, 500MB): "
        "for a model whose needed weights do not fit",
    )
    p.add_argument(
        "--tp",
        type=at_least(1),
        default=default.tp,
        metavar="N",
        help="under torchrun: each N ranks shard one copy of the model (tensor parallelism) and the "
        "copies split the batches (TP x DP; N divides --nproc_per_node)",
    )
    p.add_argument(
        "--workers",
        type=at_least(0),
        default=default.workers,
        metavar="N",
        help="processes that tokenize text ahead of the model (default 0: the data thread, "
        "with the tokenizer's own threads); raise it when the run says it is bound by "
        "tokenization",
    )
    p.add_argument(
        "--stack",
        action="store_true",
        help="store each glob of --points as one column named by the glob, [rows, blocks, d] in "
        "block order: crosscoder and cross-layer transcoder reads gather each row in one "
        "piece",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--generate",
        type=at_least(0),
        default=default.generate,
        metavar="N",
        help="also store N greedy tokens the model generates after each sequence",
    )
    p.add_argument(
        "--engine",
        choices=["vllm"],
        default=default.engine,
        help="run the model in a vLLM engine made from MODEL (a local Hugging Face directory): "
        "the same store, the same resume",
    )
    p.add_argument(
        "--engine-arg",
        type=engine_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of the vLLM engine (vllm.LLM's keyword arguments), e.g. "
        "max_num_batched_tokens=4096; repeat for more. Its CPU KV cache is "
        "VLLM_CPU_KVCACHE_SPACE (GiB) in the environment",
    )
    p.set_defaults(run=run)


def engine_arg(pair: str) -> tuple[str, object]:
    """KEY=VALUE: the value a number, true / false, or else text."""
    key, sep, value = pair.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{pair!r}: write KEY=VALUE, e.g. max_num_batched_tokens=4096")
    value = value.strip()
    if value.lower() in ("true", "false"):
        return key.strip(), value.lower() == "true"
    for number in (int, float):
        try:
            return key.strip(), number(value)
        except ValueError:
            pass
    return key.strip(), value


def run(args) -> int:
    from ..extract import ExtractConfig, ExtractInterrupted, extract
    from ..loading.allocator import prefer_huge_pages

    # the command's own process: huge pages before the model's weights (the first large allocation
    # fixes the setting); the Python API leaves a caller's environment as it is
    prefer_huge_pages()
    quiet_transformers()
    cfg = ExtractConfig(
        out=args.out,
        model=args.model,
        points=args.points,
        data=args.data,
        text_field=args.text_field,
        context=args.context,
        batch_size=args.batch_size,
        dtype=args.dtype,
        drop_bos=not args.keep_bos,
        max_tokens=args.max_tokens,
        device=args.device,
        shard_rows=args.shard_rows,
        on_nonfinite=args.on_nonfinite,
        revision=args.revision,
        progress=not args.no_progress,
        device_map=args.device_map,
        generate=args.generate,
        max_memory=args.max_memory,
        workers=args.workers,
        stack=args.stack,
        tp=args.tp,
        engine=args.engine,
        engine_args=dict(args.engine_arg),
    )
    try:
        print(extract(cfg))
    except ExtractInterrupted as stop:  # Ctrl-C / SIGTERM: one line, not a traceback
        print(f"hookscope: {stop}", file=sys.stderr)
        return 130
    return 0
