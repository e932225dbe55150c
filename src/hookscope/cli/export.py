"""`hookscope export DIR --format F --out O`: a store as SAELens's cache or a `datasets` folder."""

from __future__ import annotations

import sys

from .args import at_least


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a store as SAELens's cached activations or a datasets folder")
    p.add_argument("store", help="store directory")
    p.add_argument(
        "--format",
        required=True,
        choices=["saelens", "hf"],
        help="saelens: one example per sequence, the column named after the TransformerLens hook; "
        "hf: one example per row (token)",
    )
    p.add_argument("--out", required=True, help="new directory to write (datasets.load_from_disk reads it)")
    p.add_argument(
        "--point", default=None, help="saelens: the point to export (default: the store's only one)"
    )
    p.add_argument("--hook-name", default=None, help="saelens: column / hook name (default: the TL name)")
    p.add_argument(
        "--context-size",
        type=at_least(1),
        default=None,
        help="saelens: rows per example (default: the extraction context)",
    )
    p.add_argument("--columns", default=None, help="hf: comma-separated columns (default: all)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export at --out")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=run)


def _saelens(store, args) -> int:
    from ..export import export_saelens

    columns = [c for c in (args.columns or "").split(",") if c]
    if columns:
        print("hookscope: error: --columns is for --format hf; use --point for saelens", file=sys.stderr)
        return 2
    done = export_saelens(
        store,
        args.out,
        args.point,
        hook_name=args.hook_name,
        context_size=args.context_size,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    print(
        f"wrote {done.examples:,} examples of {done.context_size} x {done.d_in} {done.dtype} "
        f"({done.sequences} sequences) to {done.path}"
    )
    if done.rows_left_out:
        print(f"  {done.rows_left_out} rows after the last whole example were left out")
    print(
        f"  SAELens config: model_name={done.model_name!r}, hook_name={done.hook_name!r}, "
        f"context_size={done.context_size}, d_in={done.d_in}, use_cached_activations=True, "
        f"cached_activations_path={done.path!r}"
    )
    return 0


def _hf(store, args) -> int:
    from ..export import export_hf

    if args.point or args.hook_name or args.context_size:
        print(
            "hookscope: error: --point, --hook-name and --context-size are for --format saelens; "
            "use --columns for hf",
            file=sys.stderr,
        )
        return 2
    columns = [c for c in args.columns.split(",") if c] if args.columns else None
    path = export_hf(store, args.out, columns, overwrite=args.overwrite, progress=not args.no_progress)
    print(f"wrote {len(store):,} rows to {path} (datasets.load_from_disk({str(path)!r}))")
    return 0


def run(args) -> int:
    from ..store import open_store

    store = open_store(args.store)
    return _saelens(store, args) if args.format == "saelens" else _hf(store, args)
