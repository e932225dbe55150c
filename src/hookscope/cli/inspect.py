"""`hookscope inspect DIR`: summarise and verify a store."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="summarise and check a store")
    p.add_argument("dir", help="store directory or URL")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the checksum check of every shard (xxh3_128, or SHA-256 in older stores)",
    )
    p.set_defaults(run=run)


def run(args) -> int:
    from ..errors import StoreError
    from ..store import open_store

    store = open_store(args.dir)
    m = store.manifest
    if len(store) == 0:
        raise StoreError(
            f"{store.path} holds 0 rows: nothing was extracted into it yet (a run stopped "
            "before its first shard?); run the extract command again to fill it"
        )
    print(f"{store.path}: {len(store):,} rows in {store.num_shards} shards, {m.bytes / 2**20:,.1f} MiB")
    settings = m.settings
    for key in ("model", "data", "context", "batch_size", "dtype", "drop_bos", "world_size"):
        if key in settings:
            print(f"  {key}: {settings[key]}")
    if m.world_size > 1 or m.generation:  # not a setting: a resume may use another count
        print(f"  processes: {m.world_size}" + (f" (in attempt {m.generation + 1})" if m.generation else ""))
    meanings = held_meanings(settings)
    print("  points (statistics over the rows without NaN/Inf; every dimension's: store.stats[point]):")
    for name, col in store.points.items():
        st = store.stats.get(name)
        norms = ""
        if st and st.norm_count:
            norms = (
                f"row L2 norm {st.norm_mean:.3f} +/- {st.norm_std:.3f}, "
                f"mean squared norm {st.mean_squared_norm:.4g}"
            )
            if st.mean is not None and st.std is not None:  # merged from every shard's header
                norms += (
                    f"; per-dim mean {float(st.mean.min()):.3g}..{float(st.mean.max()):.3g}, "
                    f"std {float(st.std.min()):.3g}..{float(st.std.max()):.3g}"
                )
            elif name in store.stats.missing:
                norms += f"; no per-dim statistics: {store.stats.missing[name]}"
        bad = f", {st.nonfinite} NaN/Inf" if st and st.nonfinite else ""
        print(f"    {name}: {list(col.shape)} {col.dtype}  {norms}{bad}")
        members = settings.get("stacked", {}).get(name, [name])  # --stack: the points it holds
        if members != [name]:
            print(f"      stacked: [:, 0] is {members[0]}, ..., [:, {len(members) - 1}] is {members[-1]}")
        meaning = next((meanings[p] for p in members if p in meanings), None)  # one name, one meaning
        if meaning:
            print(f"      meaning: {meaning}")
    print("  per-row columns: " + ", ".join(f"{k} ({v.dtype})" for k, v in store.meta.items()))
    if not args.no_verify:
        store.verify()
        print(f"  verified: {store.num_shards} shards, sizes and checksums match the manifest")
    return 0


def held_meanings(settings: dict) -> dict[str, str]:
    """What each stored point whose name changed meaning holds: the meaning the store recorded, or,
    for a store written before it recorded one, the earlier meaning (known from the model's class)."""
    import re

    from ..arch import meaning_changes_of_class
    from ..store.meanings import KEY

    if KEY in settings:
        return {point: record["means"] for point, record in settings[KEY].items()}
    changes = meaning_changes_of_class(settings.get("model_class", ""))
    held = {}
    for point in settings.get("points", []):
        suffix = re.sub(r"^blocks\.\d+\.", "", point)
        if suffix in changes:
            held[point] = (
                f"{changes[suffix][1]} (written before hookscope gave the name TransformerLens's meaning)"
            )
    return held
