"""The `hookscope` command. Thin: it parses arguments and calls the rooms; no logic lives here.

    hookscope points [MODEL]                 list hook points (with shapes on a sample sentence)
    hookscope capture [MODEL] --point P      capture one point on a sentence and summarise it
    hookscope extract [MODEL] --out DIR      stream points of a dataset to a sharded store
    hookscope inspect DIR                    summarise and verify a store
    hookscope profile [MODEL]                time and memory per block, trace, picture
    hookscope export DIR --format F --out O  a store as SAELens's cache or a `datasets` folder
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

DEFAULT_TEXT = "Interpretability starts with looking at the activations."


def _quiet_transformers() -> None:
    # transformers prints load-progress bars and advisory warnings that drown our output
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging

        logging.set_verbosity_error()
        logging.disable_progress_bar()
    except ImportError:
        pass


def _load(args):
    import hookscope as hs

    _quiet_transformers()
    return hs.load(args.model, device=args.device)


def _encode(loaded, text: str):
    from .errors import HookscopeError

    if loaded.tokenizer is None:
        raise HookscopeError("this model has no tokenizer; give token ids from Python instead")
    inputs = dict(loaded.tokenizer([text], return_tensors="pt"))
    if inputs["input_ids"].shape[-1] == 0:
        raise HookscopeError(f"--text {text!r} gives no tokens; give some text")
    return inputs


def cmd_points(args) -> int:
    import hookscope as hs

    loaded = _load(args)
    example = _encode(loaded, args.text) if args.text else None
    infos = hs.points(loaded.model, example, pattern=args.pattern)
    print(f"{loaded.name}: {type(loaded.model).__name__}, family {loaded.arch.family}, "
          f"{loaded.arch.n_layers} blocks, {len(loaded.arch.names)} points")
    width = max(len(i.name) for i in infos)
    for i in infos:
        shape = f"  {list(i.shape)}" if i.shape else ""
        where = f"{i.module}:{i.io}" + (f" ({i.view})" if i.view else "")
        print(f"  {i.name:<{width}}  {where}{shape}")
    print("Raw modules too: module:<dotted.path>:input|output (see print(model)).")
    return 0


def cmd_capture(args) -> int:
    import torch

    import hookscope as hs

    loaded = _load(args)
    inputs = _encode(loaded, args.text)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    acts = hs.collect(loaded.model, inputs, args.point, positions=args.positions, dtype=dtype)
    tokens = loaded.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0])
    print(f"{loaded.name} on {args.text!r} ({len(tokens)} tokens: {' '.join(tokens)})")
    for name, act in acts.items():
        x = act.float()
        print(f"  {name}: shape {list(act.shape)} {act.dtype}  mean {x.mean():+.4f}  std {x.std():.4f}  "
              f"max |x| {x.abs().max():.4f}")
    if args.save:
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        from .errors import HookscopeError

        try:
            save_file({k: v.contiguous() for k, v in acts.items()}, args.save)
        except (OSError, SafetensorError) as e:
            raise HookscopeError(f"cannot write --save {args.save}: {e}") from e
        print(f"  saved to {args.save}")
    return 0


def cmd_extract(args) -> int:
    from .extract import ExtractConfig, extract

    _quiet_transformers()
    cfg = ExtractConfig(
        out=args.out, model=args.model, points=args.points, data=args.data, text_field=args.text_field,
        context=args.context, batch_size=args.batch_size, dtype=args.dtype, drop_bos=not args.keep_bos,
        max_tokens=args.max_tokens, device=args.device, shard_rows=args.shard_rows,
        on_nonfinite=args.on_nonfinite, revision=args.revision, progress=not args.no_progress,
        device_map=args.device_map,
    )
    print(extract(cfg))
    return 0


def cmd_inspect(args) -> int:
    from .store import open_store

    store = open_store(args.dir)
    m = store.manifest
    print(f"{store.path}: {len(store):,} rows in {store.num_shards} shards, {m.bytes / 2**20:,.1f} MiB")
    settings = m.settings
    for key in ("model", "data", "context", "batch_size", "dtype", "drop_bos", "world_size"):
        if key in settings:
            print(f"  {key}: {settings[key]}")
    print("  points:")
    for name, col in store.points.items():
        st = store.stats.get(name)
        norms = f"row L2 norm {st.norm_mean:.3f} +/- {st.norm_std:.3f}" if st and st.norm_count else ""
        bad = f", {st.nonfinite} NaN/Inf" if st and st.nonfinite else ""
        print(f"    {name}: {list(col.shape)} {col.dtype}  {norms}{bad}")
    print("  per-row columns: " + ", ".join(f"{k} ({v.dtype})" for k, v in store.meta.items()))
    if not args.no_verify:
        store.verify()
        print(f"  verified: {store.num_shards} shards, sizes and SHA-256 match the manifest")
    return 0


def cmd_export(args) -> int:
    from .export import export_hf, export_saelens
    from .store import open_store

    store = open_store(args.store)
    if args.format == "saelens":
        columns = [c for c in (args.columns or "").split(",") if c]
        if columns:
            print("hookscope: error: --columns is for --format hf; use --point for saelens", file=sys.stderr)
            return 2
        done = export_saelens(store, args.out, args.point, hook_name=args.hook_name,
                              context_size=args.context_size, overwrite=args.overwrite,
                              progress=not args.no_progress)
        print(f"wrote {done.examples:,} examples of {done.context_size} x {done.d_in} {done.dtype} "
              f"({done.sequences} sequences) to {done.path}")
        if done.rows_left_out:
            print(f"  {done.rows_left_out} rows after the last whole example were left out")
        print(f"  SAELens config: model_name={done.model_name!r}, hook_name={done.hook_name!r}, "
              f"context_size={done.context_size}, d_in={done.d_in}, use_cached_activations=True, "
              f"cached_activations_path={done.path!r}")
        return 0
    if args.point or args.hook_name or args.context_size:
        print("hookscope: error: --point, --hook-name and --context-size are for --format saelens; "
              "use --columns for hf", file=sys.stderr)
        return 2
    columns = [c for c in args.columns.split(",") if c] if args.columns else None
    path = export_hf(store, args.out, columns, overwrite=args.overwrite, progress=not args.no_progress)
    print(f"wrote {len(store):,} rows to {path} (datasets.load_from_disk({str(path)!r}))")
    return 0


def cmd_profile(args) -> int:
    import torch

    import hookscope as hs

    from .compile import compile_stats, reset_stats
    from .extract import max_positions

    _quiet_transformers()
    loaded = hs.load(args.model, device=args.device, dtype=args.dtype, compile=args.compile)
    longest = max_positions(loaded.model)
    if longest is not None and args.seq > longest:
        raise hs.HookscopeError(f"--seq {args.seq} is longer than the model's {longest} positions; "
                                f"use --seq {longest} or less")
    vocab = loaded.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)  # random tokens: timing does not depend on the text
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(args.device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    reset_stats()
    report = hs.profile(loaded.model, inputs, backward=args.backward, steps=args.steps, warmup=args.warmup)
    report.compile_stats = compile_stats()  # graph breaks and recompiles, shown in the summary
    if args.out:
        report.write(args.out)
    print(report.summary())
    if args.out:
        print(f"files in {args.out}: table.txt, trace.json (chrome://tracing or ui.perfetto.dev), "
              "time_per_block.png, report.html")
    return 0


def _device(value: str) -> str:
    """A device this machine has: cpu, cuda, cuda:N or mps."""
    import torch

    try:
        device = torch.device(value)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a device: use cpu, cuda or cuda:N") from None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= gpus:
        raise argparse.ArgumentTypeError(f"{value}: this machine has {gpus} CUDA device(s); use --device cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError("mps is not available on this machine; use --device cpu")
    if device.type not in ("cpu", "cuda", "mps"):
        raise argparse.ArgumentTypeError(f"{value!r}: use cpu, cuda, cuda:N or mps")
    return value


def _at_least(minimum: int):
    def parse(value: str) -> int:
        number = int(value)  # a ValueError becomes argparse's "invalid value" message
        if number < minimum:
            raise argparse.ArgumentTypeError(f"{number} is less than {minimum}")
        return number

    parse.__name__ = f"int >= {minimum}"  # how argparse names the type in its messages
    return parse


def _positions(value: str | None):
    if value is None or value == "all":
        return None
    if value == "last":
        return "last"
    if ":" in value:
        start, _, stop = value.partition(":")
        return slice(int(start) if start else None, int(stop) if stop else None)
    return [int(v) for v in value.split(",")] if "," in value else int(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hookscope", description="Look inside PyTorch models.")
    sub = parser.add_subparsers(dest="command", required=True)

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("model", nargs="?", default=None,
                       help="Hugging Face id or local directory (default: the bundled all-MiniLM-L6-v2)")
        p.add_argument("--device", default="cpu", type=_device, help="cpu, cuda, cuda:N or mps")

    p = sub.add_parser("points", help="list a model's hook points")
    model_args(p)
    p.add_argument("--text", default=DEFAULT_TEXT,
                   help="sample input for shapes ('' to skip the forward pass)")
    p.add_argument("--pattern", default=None,
                   help="only names matching this glob, e.g. 'blocks.*.resid_post'")
    p.set_defaults(run=cmd_points)

    p = sub.add_parser("capture", help="capture point(s) on one sentence and summarise them")
    model_args(p)
    p.add_argument("--point", required=True, help="point name(s), comma-separated or a glob")
    p.add_argument("--text", default=DEFAULT_TEXT)
    p.add_argument("--positions", type=_positions, default=None, help="all | last | N | A:B | i,j,k")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    p.add_argument("--save", default=None, help="write the captures to this .safetensors file")
    p.set_defaults(run=cmd_capture)

    from .extract import DEFAULT_DATA, DEFAULT_POINT

    p = sub.add_parser("extract", help="stream chosen points of a dataset to a sharded store (resumable)")
    model_args(p)
    p.add_argument("--out", required=True, help="store directory (re-run the same command to resume)")
    p.add_argument("--points", type=lambda v: [x for x in v.split(",") if x], default=[DEFAULT_POINT],
                   help=f"comma-separated point names or globs (default {DEFAULT_POINT})")
    p.add_argument("--data", default=DEFAULT_DATA,
                   help=".txt / .jsonl file, a directory of them, a saved HF dataset dir, hf:NAME[:split], "
                        f"or {DEFAULT_DATA} (default; built offline from Python's docstrings)")
    p.add_argument("--text-field", default="text", help="field holding the text in .jsonl / datasets")
    p.add_argument("--context", type=int, default=128, help="tokens per packed sequence")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--keep-bos", action="store_true",
                   help="also store BOS / CLS / SEP tokens (dropped by default)")
    p.add_argument("--max-tokens", type=int, default=None, help="stop after this many tokens")
    p.add_argument("--shard-rows", type=int, default=65536, help="rows per shard file")
    p.add_argument("--on-nonfinite", default="warn", choices=["warn", "error"],
                   help="NaN/Inf activations: count and report (warn), or refuse to write them (error)")
    p.add_argument("--revision", default=None, help="model revision (hub ids)")
    p.add_argument("--device-map", default=None,
                   help="'auto' spreads a model bigger than one device (accelerate)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=cmd_extract)

    p = sub.add_parser("profile", help="where time and memory go, per block and hooked point")
    model_args(p)
    p.add_argument("--batch", type=_at_least(1), default=8)
    p.add_argument("--seq", type=_at_least(1), default=128,
                   help="tokens per sequence (at most the model's positions)")
    p.add_argument("--backward", action="store_true", help="profile forward + backward")
    p.add_argument("--compile", default=None, choices=["off", "blocks", "full"],
                   help="compile policy (default: $HOOKSCOPE_COMPILE, else off)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    p.add_argument("--steps", type=_at_least(1), default=5)
    p.add_argument("--warmup", type=_at_least(0), default=2)
    p.add_argument("--out", default=None, help="write table, trace, picture and HTML page here")
    p.set_defaults(run=cmd_profile)

    p = sub.add_parser("export", help="write a store as SAELens's cached activations or a datasets folder")
    p.add_argument("store", help="store directory")
    p.add_argument("--format", required=True, choices=["saelens", "hf"],
                   help="saelens: one example per sequence, the column named after the TransformerLens hook; "
                        "hf: one example per row (token)")
    p.add_argument("--out", required=True, help="new directory to write (datasets.load_from_disk reads it)")
    p.add_argument("--point", default=None,
                   help="saelens: the point to export (default: the store's only one)")
    p.add_argument("--hook-name", default=None, help="saelens: column / hook name (default: the TL name)")
    p.add_argument("--context-size", type=_at_least(1), default=None,
                   help="saelens: rows per example (default: the extraction context)")
    p.add_argument("--columns", default=None, help="hf: comma-separated columns (default: all)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export at --out")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=cmd_export)

    p = sub.add_parser("inspect", help="summarise and check a store")
    p.add_argument("dir")
    p.add_argument("--no-verify", action="store_true", help="skip the SHA-256 check of every shard")
    p.set_defaults(run=cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from .errors import HookscopeError

    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except HookscopeError as exc:
        print(f"hookscope: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
