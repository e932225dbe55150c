"""Two stores written with the same settings (e.g. by main and by a branch), file by file: which
files are byte-identical; for a JSON file that is not, the fields that differ; for a shard that is
not, whether its tensors' bytes and entries and its other metadata are, and how far its
per-dimension statistics (the `hookscope.stats` header) are from each other and from a float64
recomputation from the stored rows. before_after.py compares the stores its trees write with it.

    python bench/probe_store_diff.py STORE_A STORE_B
"""

from __future__ import annotations

import argparse
import base64
import json
import struct
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

STATS_KEY = "hookscope.stats"


def files_apart(a: Path, b: Path) -> tuple[list[Path], list[Path]]:
    """The files of two stores (names relative to each), and those whose bytes differ or that one
    store lacks."""
    names = {f.relative_to(a) for f in a.rglob("*") if f.is_file()}
    names |= {f.relative_to(b) for f in b.rglob("*") if f.is_file()}
    differing = [
        rel
        for rel in sorted(names)
        if not ((a / rel).is_file() and (b / rel).is_file())
        or (a / rel).read_bytes() != (b / rel).read_bytes()
    ]
    return sorted(names), differing


def json_differences(x: object, y: object, at: str = "") -> list[str]:
    """The paths (`shards[2].stats`) at which two parsed JSON documents hold different values."""
    if isinstance(x, dict) and isinstance(y, dict):
        return [
            found
            for key in sorted(x.keys() | y.keys())
            for found in json_differences(x.get(key), y.get(key), f"{at}.{key}" if at else key)
        ]
    if isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        pairs = enumerate(zip(x, y, strict=True))
        return [found for i, (u, v) in pairs for found in json_differences(u, v, f"{at}[{i}]")]
    return [] if x == y else [at or "(the whole document)"]


def header(data: bytes) -> tuple[dict, int]:
    size = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + size]), 8 + size


def vectors(text: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {
        point: tuple(
            torch.from_numpy(np.frombuffer(base64.b64decode(s[k]), "<f8").copy()) for k in ("mean", "m2")
        )
        for point, s in json.loads(text).items()
    }


def errors(shard: Path, stats: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """The largest |mean - float64 mean| / std and |M2 - float64 M2| / M2 over the points' dimensions."""
    rows, worst_mean, worst_m2 = load_file(str(shard)), 0.0, 0.0
    for point, (mean, m2) in stats.items():
        x = rows[point].reshape(len(rows[point]), -1).double()
        x = x[torch.isfinite(x).all(dim=1)]
        want = x.mean(0)
        want_m2 = ((x - want) ** 2).sum(0)
        worst_mean = max(worst_mean, float(((mean - want).abs() / (want_m2 / len(x)).sqrt()).max()))
        worst_m2 = max(worst_m2, float(((m2 - want_m2).abs() / want_m2).max()))
    return worst_mean, worst_m2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    args = p.parse_args()
    names, differing = files_apart(args.a, args.b)
    both = all((args.a / rel).is_file() and (args.b / rel).is_file() for rel in names)
    print(f"{len(names)} files; the same names: {both}")
    for rel in names:
        if rel not in differing:
            print(f"  identical  {rel}")
            continue
        if not (args.a / rel).is_file() or not (args.b / rel).is_file():
            print(f"  only in one store: {rel}")
            continue
        x, y = (args.a / rel).read_bytes(), (args.b / rel).read_bytes()
        if rel.suffix != ".safetensors":
            fields = json_differences(json.loads(x), json.loads(y)) if rel.suffix == ".json" else []
            print(f"  differs    {rel} ({len(x):,} and {len(y):,} bytes) {', '.join(fields)}")
            continue
        (hx, at_x), (hy, at_y) = header(x), header(y)
        mx, my = hx.pop("__metadata__"), hy.pop("__metadata__")
        sx, sy = vectors(mx.pop(STATS_KEY)), vectors(my.pop(STATS_KEY))
        apart = max(
            float(((u - v).abs() / v.abs().clamp(min=1e-300)).max())
            for point in sx
            for u, v in zip(sx[point], sy[point], strict=True)
        )
        ea, eb = errors(args.a / rel, sx), errors(args.b / rel, sy)
        print(
            f"  differs    {rel}: tensor bytes identical {x[at_x:] == y[at_y:]}, entries {hx == hy}, "
            f"other metadata {mx == my}; per-dimension mean/M2 apart by {apart:.1e} (relative); "
            f"from float64: mean {ea[0]:.1e} / {eb[0]:.1e} of the std, M2 {ea[1]:.1e} / {eb[1]:.1e}"
        )


if __name__ == "__main__":
    main()
