"""The `hookscope` command. Thin: it parses arguments and calls the rooms; no logic lives here.

    hookscope points [MODEL]                 list hook points (with shapes on a sample sentence)
    hookscope capture [MODEL] --points P     capture point(s) on a sentence and summarise them
    hookscope extract [MODEL] --out DIR      stream points of a dataset to a sharded store
    hookscope inspect DIR                    summarise and verify a store
    hookscope profile [MODEL]                time and memory per block, trace, picture
    hookscope top DIR --point P --unit N     the contexts where a unit (or SAE feature) is largest
    hookscope generate MODEL --prompt TEXT   generate text, capturing / steering points on the way
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

    from .sources import images

    text = args.text
    if images.has_image_processor(args.model):  # a vision encoder: shapes on a sample image
        _quiet_transformers()
        loaded = hs.load(args.model, device=args.device, tokenizer=False)
        example = images.sample_input(args.model, args.device) if args.text else None
    else:
        loaded = _load(args)
        example = _encode(loaded, text) if text else None
        heads = loaded.arch.n_heads
        while (example is not None and args.text == DEFAULT_TEXT and heads
               and example["input_ids"].shape[-1] == heads):  # [1, 12, 12, 32] could not be read
            text += " Again."
            example = _encode(loaded, text)
    infos = hs.points(loaded.model, example, pattern=args.pattern)
    print(f"{loaded.name}: {type(loaded.model).__name__}, family {loaded.arch.family}, "
          f"{loaded.arch.n_layers} blocks, {len(loaded.arch.names)} points")
    if example is not None and "input_ids" in example:  # a vision model's sample image has none
        print(f"shapes on {text!r} ({example['input_ids'].shape[-1]} tokens; --text to change it)")
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
    acts = hs.collect(loaded.model, inputs, args.points, positions=args.positions, dtype=dtype)
    tokens = loaded.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0])
    print(f"{loaded.name} on {args.text!r} ({len(tokens)} tokens: {' '.join(tokens)})")
    for name, act in acts.items():
        x = act.float()
        print(f"  {name}: shape {list(act.shape)} {act.dtype}  mean {x.mean():+.4f}  std {x.std():.4f}  "
              f"max |x| {x.abs().max():.4f}")
    if args.save:
        from pathlib import Path

        from safetensors import SafetensorError
        from safetensors.torch import save

        from .errors import HookscopeError

        try:  # a plain write: the file gets the umask's mode (safetensors' save_file makes it 0600)
            Path(args.save).write_bytes(save({k: v.contiguous() for k, v in acts.items()}))
        except (OSError, SafetensorError) as e:
            raise HookscopeError(f"cannot write --save {args.save}: {e}") from e
        print(f"  saved to {args.save}")
    return 0


def cmd_extract(args) -> int:
    from .extract import ExtractConfig, ExtractInterrupted, extract

    _quiet_transformers()
    cfg = ExtractConfig(
        out=args.out, model=args.model, points=args.points, data=args.data, text_field=args.text_field,
        context=args.context, batch_size=args.batch_size, dtype=args.dtype, drop_bos=not args.keep_bos,
        max_tokens=args.max_tokens, device=args.device, shard_rows=args.shard_rows,
        on_nonfinite=args.on_nonfinite, revision=args.revision, progress=not args.no_progress,
        device_map=args.device_map, generate=args.generate, max_memory=args.max_memory,
    )
    try:
        print(extract(cfg))
    except ExtractInterrupted as stop:  # Ctrl-C / SIGTERM: one line, not a traceback
        print(f"hookscope: {stop}", file=sys.stderr)
        return 130
    return 0


def cmd_inspect(args) -> int:
    from .errors import StoreError
    from .store import open_store

    store = open_store(args.dir)
    m = store.manifest
    if len(store) == 0:
        raise StoreError(f"{store.path} holds 0 rows: nothing was extracted into it yet (a run stopped "
                         "before its first shard?); run the extract command again to fill it")
    print(f"{store.path}: {len(store):,} rows in {store.num_shards} shards, {m.bytes / 2**20:,.1f} MiB")
    settings = m.settings
    for key in ("model", "data", "context", "batch_size", "dtype", "drop_bos", "world_size"):
        if key in settings:
            print(f"  {key}: {settings[key]}")
    if m.world_size > 1 or m.generation:  # the settings no longer hold it (a resume may change it)
        print(f"  processes: {m.world_size}" + (f" (in attempt {m.generation + 1})" if m.generation else ""))
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

    from .compiling import compile_stats, reset_stats
    from .inputs import max_positions
    from .profiling.report import writable_dir

    _quiet_transformers()
    if args.out:
        writable_dir(args.out)  # before minutes of profiling, not after
    loaded = hs.load(args.model, device=args.device, dtype=args.dtype, compile_policy=args.compile)
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
    print(report.summary(), flush=True)  # first: whatever happens to the files, the profile is shown
    if args.out:
        files = report.write(args.out)
        names = ", ".join(p.name + (" (chrome://tracing or ui.perfetto.dev)" if kind == "trace" else "")
                          for kind, p in files.items())
        print(f"files in {args.out}: {names}")
    return 0


def _store_tokenizer(store, override: str | None):
    """The tokenizer a store was made with: its settings name the model (a path, a hub id, or the
    bundled default); refused if it is not the one whose hash the store recorded."""
    from transformers import AutoTokenizer

    from .errors import HookscopeError
    from .models import resolve_source
    from .sources.identity import tokenizer_sha256

    name = override or store.manifest.settings.get("model")
    if not name:
        raise HookscopeError(f"{store.path}: the store's settings name no model, so its tokenizer is "
                             "unknown; give --tokenizer PATH_OR_ID")
    if override and os.path.isdir(override):  # a tokenizer saved alone has no config.json
        source, local = override, True
    else:
        source, local = resolve_source(name)
    try:
        tok = AutoTokenizer.from_pretrained(source, local_files_only=local)
    except (OSError, ValueError) as e:
        raise HookscopeError(f"cannot load the tokenizer of {name!r} ({e}); "
                             "give --tokenizer PATH_OR_ID") from e
    recorded = store.manifest.settings.get("tokenizer_sha256")
    if recorded and tokenizer_sha256(tok) != recorded:
        raise HookscopeError(f"the tokenizer of {name!r} is not the one this store was made with (its hash "
                             "differs from the manifest's tokenizer_sha256); give the right --tokenizer")
    return tok


def _units(value: str) -> list[int] | range:
    if ":" in value:
        start, _, stop = value.partition(":")
        return range(int(start or 0), int(stop))
    return [int(v) for v in value.split(",") if v]


def cmd_top(args) -> int:
    from .errors import HookscopeError
    from .store import open_store
    from .top import get_index, page_data, resolve_encoder, top, write_page

    _quiet_transformers()
    store = open_store(args.dir)
    point = args.point
    if point is None:
        if len(store.points) != 1:
            raise HookscopeError(f"the store has {len(store.points)} points {list(store.points)}; choose one "
                                 "with --point")
        point = next(iter(store.points))
    if args.unit is None and args.html is None:
        raise HookscopeError("give --unit N (terminal) or --html FILE (a page for every unit), or both")
    tokenizer = _store_tokenizer(store, args.tokenizer)
    index_k = max(args.k, args.index_k)
    if args.unit is not None:
        print(top(store, point, args.unit, k=args.k, context=args.context, sae=args.sae, tokenizer=tokenizer,
                  rebuild=args.rebuild, index_k=index_k, progress=not args.no_progress))
    if args.html is not None:
        encoder = resolve_encoder(store, point, args.sae)
        rebuild = args.rebuild and args.unit is None  # with --unit, the query above rebuilt it already
        index = get_index(store, point, encoder=encoder, k=index_k, rebuild=rebuild,
                          progress=not args.no_progress)
        data = page_data(store, index, encoder, units=args.units, k=args.k, context=args.context,
                         tokenizer=tokenizer, progress=not args.no_progress)
        print(f"wrote {write_page(args.html, data)} ({len(data['units'])} units)")
    return 0


def _steer_arg(value: str):
    """POINT:VECTOR_FILE:SCALE (split from the right: a point name may hold colons)."""
    parts = value.rsplit(":", 2)
    if len(parts) != 3 or not parts[0] or not parts[1]:
        raise argparse.ArgumentTypeError(f"--steer {value!r}: use POINT:VECTOR_FILE:SCALE, "
                                         "e.g. blocks.3.resid_post:vec.safetensors:4")
    try:
        scale = float(parts[2])
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steer {value!r}: the scale {parts[2]!r} is not a "
                                         "number") from None
    return parts[0], parts[1], scale


def _read_vector(path: str):
    """A steering vector from a .safetensors file (one tensor) or a .npy file; never a pickle."""
    import numpy as np
    import torch

    from .errors import HookscopeError

    try:
        if path.endswith(".npy"):
            return torch.from_numpy(np.load(path, allow_pickle=False))
        from safetensors.torch import load_file

        tensors = load_file(path)
    except (OSError, ValueError) as e:
        raise HookscopeError(f"cannot read steering vector {path}: {e}") from e
    except Exception as e:  # safetensors raises its own error type for a malformed file
        raise HookscopeError(f"cannot read steering vector {path}: {e} (give a .safetensors or .npy "
                             "file)") from e
    if len(tensors) != 1:
        raise HookscopeError(f"{path} holds {len(tensors)} tensors ({', '.join(tensors)}); a steering vector "
                             "file must hold exactly one")
    return next(iter(tensors.values()))


def cmd_generate(args) -> int:
    import torch

    import hookscope as hs

    from .errors import HookscopeError

    loaded = _load(args)
    tok = loaded.tokenizer
    if tok is None:
        raise HookscopeError("this model has no tokenizer; call hs.generate from Python with token ids")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"  # a decoder continues after the last column
    inputs = dict(tok(args.prompt, return_tensors="pt", padding=True))
    inputs.pop("token_type_ids", None)
    inputs = {k: v.to(args.device) for k, v in inputs.items()}
    edits = [hs.steer(point, _read_vector(path), scale=scale) for point, path, scale in args.steer]
    points = [p for p in args.points.split(",") if p] if args.points else []
    if args.out and not points:
        raise HookscopeError("--out writes captures: give --points too")
    options = {"max_new_tokens": args.max_new_tokens, "pad_token_id": tok.pad_token_id}
    if args.sample:
        torch.manual_seed(args.seed)
        options.update(do_sample=True, temperature=args.temperature, top_k=args.top_k)
    else:
        options.update(do_sample=False)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    gen = hs.generate(loaded.model, inputs, points, edits=edits, edit_on=args.edit_on,
                      positions=args.positions, dtype=dtype, device="cpu", **options)
    for prompt, text in zip(args.prompt, gen.text(tok), strict=True):
        print(f"{prompt}{text}")
    if args.out:
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        tensors = {name: act.contiguous() for name, act in gen.activations.items()}
        tensors.update(sequences=gen.sequences.cpu().contiguous(), mask=gen.mask.cpu().contiguous())
        metadata = {"model": loaded.name, "prompt_length": str(gen.prompt_length),
                    "positions": str(args.positions), "edit_on": args.edit_on,
                    "steer": ";".join(f"{p}:{f}:{s}" for p, f, s in args.steer)}
        try:
            save_file(tensors, args.out, metadata=metadata)
        except (OSError, SafetensorError) as e:
            raise HookscopeError(f"cannot write --out {args.out}: {e}") from e
        shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in tensors.items())
        print(f"captures written to {args.out}: {shapes}", file=sys.stderr)
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
    """all | last | N | A:B | i,j,k"""
    if value is None or value == "all":
        return None
    if value == "last":
        return "last"
    try:
        if ":" in value:
            start, _, stop = value.partition(":")
            return slice(int(start) if start else None, int(stop) if stop else None)
        return [int(v) for v in value.split(",")] if "," in value else int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a position selection: use all, last, N, A:B or i,j,k (negative N counts "
            "from the end)") from None


def _point_list(value: str) -> list[str]:
    names = [x.strip() for x in value.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{value!r} names no point; e.g. blocks.3.resid_post")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hookscope", description="Look inside PyTorch models.")
    sub = parser.add_subparsers(dest="command", required=True)

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("model", nargs="?", default=None,
                       help="Hugging Face id or local directory (default: the bundled all-MiniLM-L6-v2)")
        p.add_argument("--device", default="cpu", type=_device, help="cpu, cuda, cuda:N or mps")

    def points_arg(p: argparse.ArgumentParser, *, help: str, required: bool = False, default=None) -> None:
        # --points is the documented spelling; --point is accepted too (one point is a list of one)
        group = p.add_mutually_exclusive_group(required=required)
        group.add_argument("--points", type=_point_list, default=default, help=help)
        group.add_argument("--point", dest="points", type=_point_list, help=argparse.SUPPRESS)

    p = sub.add_parser("points", help="list a model's hook points")
    model_args(p)
    p.add_argument("--text", default=DEFAULT_TEXT,
                   help="sample input for shapes ('' to skip the forward pass)")
    p.add_argument("--pattern", default=None,
                   help="only names matching this glob, e.g. 'blocks.*.resid_post'")
    p.set_defaults(run=cmd_points)

    p = sub.add_parser("capture", help="capture point(s) on one sentence and summarise them")
    model_args(p)
    points_arg(p, required=True, help="point name(s), comma-separated or a glob")
    p.add_argument("--text", default=DEFAULT_TEXT)
    p.add_argument("--positions", type=_positions, default=None, help="all | last | N | A:B | i,j,k")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    p.add_argument("--save", default=None, help="write the captures to this .safetensors file")
    p.set_defaults(run=cmd_capture)

    from .extract import DEFAULT_DATA, DEFAULT_POINT
    from .sources import DEFAULT_CONTEXT

    p = sub.add_parser("extract", help="stream chosen points of a dataset to a sharded store (resumable)")
    model_args(p)
    p.add_argument("--out", required=True,
                   help="store directory or URL (s3://, gs://, az://, hf://, memory://); "
                        "re-run the same command to resume")
    points_arg(p, default=[DEFAULT_POINT],
               help=f"comma-separated point names or globs (default {DEFAULT_POINT})")
    p.add_argument("--data", default=DEFAULT_DATA,
                   help=".txt / .jsonl file, a directory of them, a saved HF dataset dir, hf:NAME[:split], "
                        f"or {DEFAULT_DATA} (default; built offline from Python's docstrings)")
    p.add_argument("--text-field", default="text", help="field holding the text in .jsonl / datasets")
    p.add_argument("--context", type=int, default=None,
                   help=f"tokens per packed sequence (default {DEFAULT_CONTEXT}; not for images)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--keep-bos", action="store_true",
                   help="also store BOS / CLS / SEP tokens (dropped by default)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="stop after this many tokens (whole sequences; images: whole images)")
    p.add_argument("--shard-rows", type=int, default=65536, help="rows per shard file")
    p.add_argument("--on-nonfinite", default="warn", choices=["warn", "error"],
                   help="NaN/Inf activations: count and report (warn), or refuse to write them (error)")
    p.add_argument("--revision", default=None, help="model revision (hub ids)")
    p.add_argument("--device-map", default=None,
                   help="'auto' spreads a model bigger than one device (accelerate)")
    p.add_argument("--max-memory", default=None, metavar="SIZE",
                   help="stream the blocks through chunks of batches, weights kept under SIZE (2GiB, 500MB): "
                        "for a model whose needed weights do not fit")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--generate", type=_at_least(0), default=0, metavar="N",
                   help="also store N greedy tokens the model generates after each sequence")
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

    p = sub.add_parser("top", help="the top-activating contexts of a unit or SAE feature, from a store")
    p.add_argument("dir", help="store directory")
    p.add_argument("--point", default=None, help="the point (default: the store's only one)")
    p.add_argument("--unit", type=_at_least(0), default=None, help="unit (or SAE feature) number")
    p.add_argument("--k", type=_at_least(1), default=20, help="contexts to show")
    p.add_argument("--context", type=_at_least(0), default=8, help="tokens on each side")
    p.add_argument("--sae", default=None,
                   help="SAELens SAE directory (cfg.json + sae_weights.safetensors) or an encoder "
                        ".safetensors file (W_enc + b_enc): rank its features instead of raw units")
    p.add_argument("--html", default=None, help="write a self-contained page for every unit here")
    p.add_argument("--units", type=_units, default=None, help="units on the page: A:B or i,j,k (default all)")
    p.add_argument("--index-k", type=_at_least(1), default=32, help="rows kept per unit in the saved index")
    p.add_argument("--rebuild", action="store_true", help="rebuild the saved index (after the store changed)")
    p.add_argument("--tokenizer", default=None, help="tokenizer path or id (default: the store's model)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=cmd_top)

    p = sub.add_parser("generate", help="generate text, capturing and steering points at every token")
    model_args(p)
    p.add_argument("--prompt", action="append", required=True,
                   help="prompt text (repeat for a batch; prompts are left-padded)")
    p.add_argument("--max-new-tokens", type=_at_least(1), default=20)
    p.add_argument("--points", default=None, help="point name(s) to capture, comma-separated or a glob")
    p.add_argument("--positions", type=_positions, default=None,
                   help="sequence positions to keep: all | last | N | A:B | i,j,k")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    p.add_argument("--out", default=None,
                   help="write captures (+ sequences, mask) to this .safetensors file")
    p.add_argument("--steer", type=_steer_arg, action="append", default=[],
                   help="POINT:VECTOR_FILE:SCALE, add SCALE x the vector (.safetensors / .npy) at POINT")
    p.add_argument("--edit-on", default="both", choices=["both", "prompt", "generated"],
                   help="which positions the steering applies to")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=50)
    p.set_defaults(run=cmd_generate)

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
    p.add_argument("dir", help="store directory or URL")
    p.add_argument("--no-verify", action="store_true", help="skip the SHA-256 check of every shard")
    p.set_defaults(run=cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from .errors import HookscopeError

    args = build_parser().parse_args(argv)
    try:
        code = args.run(args)
        sys.stdout.flush()  # here, so that a closed pipe is caught below and not at interpreter exit
        return code
    except HookscopeError as exc:
        print(f"hookscope: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `hookscope inspect DIR | head`: the reader left; that is not an error
        # point stdout at /dev/null so the interpreter's final flush does not raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
