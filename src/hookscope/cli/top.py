"""`hookscope top DIR --point P --unit N`: the contexts where a unit (or SAE feature) is largest."""

from __future__ import annotations

import os

from .args import at_least, quiet_transformers


def _units(value: str) -> list[int] | range:
    if ":" in value:
        start, _, stop = value.partition(":")
        return range(int(start or 0), int(stop))
    return [int(v) for v in value.split(",") if v]


def add_parser(sub) -> None:
    p = sub.add_parser("top", help="the top-activating contexts of a unit or SAE feature, from a store")
    p.add_argument("dir", help="store directory")
    p.add_argument("--point", default=None, help="the point (default: the store's only one)")
    p.add_argument("--unit", type=at_least(0), default=None, help="unit (or SAE feature) number")
    p.add_argument("--k", type=at_least(1), default=20, help="contexts to show")
    p.add_argument("--context", type=at_least(0), default=8, help="tokens on each side")
    p.add_argument(
        "--sae",
        default=None,
        help="SAELens SAE directory (cfg.json + sae_weights.safetensors) or an encoder "
        ".safetensors file (W_enc + b_enc): rank its features instead of raw units",
    )
    p.add_argument("--html", default=None, help="write a self-contained page for every unit here")
    p.add_argument("--units", type=_units, default=None, help="units on the page: A:B or i,j,k (default all)")
    p.add_argument("--index-k", type=at_least(1), default=32, help="rows kept per unit in the saved index")
    p.add_argument("--rebuild", action="store_true", help="rebuild the saved index (after the store changed)")
    p.add_argument("--tokenizer", default=None, help="tokenizer path or id (default: the store's model)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(run=run)


def _store_tokenizer(store, override: str | None):
    """The tokenizer a store was made with: its settings name the model (a path, a hub id, or the
    bundled default); refused if it is not the one whose hash the store recorded."""
    from ..errors import HookscopeError
    from ..loading import load_tokenizer

    settings = store.manifest.settings
    name = override or settings.get("model")
    if not name:
        raise HookscopeError(
            f"{store.path}: the store's settings name no model, so its tokenizer is "
            "unknown; give --tokenizer PATH_OR_ID"
        )
    # a tokenizer saved alone has no config.json
    return load_tokenizer(
        name, saved_alone=bool(override) and os.path.isdir(override), sha256=settings.get("tokenizer_sha256")
    )


def _only_point(store, point: str | None) -> str:
    from ..errors import HookscopeError

    if point is not None:
        return point
    if len(store.points) != 1:
        raise HookscopeError(
            f"the store has {len(store.points)} points {list(store.points)}; choose one with --point"
        )
    return next(iter(store.points))


def _page(store, point: str, tokenizer, args) -> None:
    from ..top import get_index, page_data, resolve_encoder, write_page

    encoder = resolve_encoder(store, point, args.sae)
    rebuild = args.rebuild and args.unit is None  # with --unit, the query above rebuilt it already
    index = get_index(
        store,
        point,
        encoder=encoder,
        k=max(args.k, args.index_k),
        rebuild=rebuild,
        progress=not args.no_progress,
    )
    data = page_data(
        store,
        index,
        encoder,
        units=args.units,
        k=args.k,
        context=args.context,
        tokenizer=tokenizer,
        progress=not args.no_progress,
    )
    print(f"wrote {write_page(args.html, data)} ({len(data['units'])} units)")


def run(args) -> int:
    from ..errors import HookscopeError
    from ..store import open_store
    from ..top import top

    quiet_transformers()
    store = open_store(args.dir)
    point = _only_point(store, args.point)
    if args.unit is None and args.html is None:
        raise HookscopeError("give --unit N (terminal) or --html FILE (a page for every unit), or both")
    tokenizer = _store_tokenizer(store, args.tokenizer)
    if args.unit is not None:
        print(
            top(
                store,
                point,
                args.unit,
                k=args.k,
                context=args.context,
                sae=args.sae,
                tokenizer=tokenizer,
                rebuild=args.rebuild,
                index_k=max(args.k, args.index_k),
                progress=not args.no_progress,
            )
        )
    if args.html is not None:
        _page(store, point, tokenizer, args)
    return 0
