"""Steady-state shuffled reading against the in-RAM floor, interleaved in one process.

`bench_read.py` times each case in its own process (first epoch, mapping and page-table set-up
included). This probe times what a long training run sees after its first epoch: in each round,
one epoch of the fastest floor (the column in numpy-allocated, huge-page memory, gathered in
random batches of 4,096 by torch's `index_select` or numpy's `take`, or by `index_select` into one
batch buffer faulted in once) and then one epoch of
`store.dataset(...)` (mappings kept), and prints the median ratio of the rounds, so load drifts
on a shared machine hit both sides of each ratio alike. Run it once per tree to compare trees:

    PYTHONPATH=src .venv/bin/python bench/probe_read.py 768 float16 9 [warm4k] [--one-header]
    PYTHONPATH=bench/out/read/src-1dec836/src .venv/bin/python bench/probe_read.py 768 float16 9
    PYTHONPATH=src .venv/bin/python bench/probe_read.py 768 bfloat16 9 --layout=stack   # or clt

It reads the stores `bench_read.py` builds (run that first), after putting them in the page cache
as `bench_read.py`'s warm case does (2 MiB folios; `warm4k`: small ones). `--one-header` reads
(and first builds) a twin store whose shard headers all have one length (`build_store`).
`--layout=stack|clt` reads bench_read.py's stacked layouts (the same bytes as 4 or 8 points read
as stacks): the floors then gather the columns side by side in each row (`[rows, columns * d]`),
and floor-cols, in the store's layout (each column a block of rows), is printed beside.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch
from bench_read import LAYOUTS, build_store, store_dir, warm_cache

import hookscope as hs

SHAPES = {768: (262_144, 65_536), 4096: (131_072, 16_384)}  # rows, buffer_rows (as bench_read.py)
POINT, BATCH = "blocks.0.resid_post", 4096


def main() -> None:
    flags = {a for a in sys.argv[4:] if a.startswith("--")}
    layout = next((a.split("=", 1)[1] for a in flags if a.startswith("--layout=")), "point")
    d, dtype, rounds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    point, stack, points = LAYOUTS[layout]
    k = len(points)
    rows, buffer_rows = SHAPES[d][0] // k, SHAPES[d][1] // k  # the same bytes in every layout
    path = (
        build_store(d, dtype, False, first_batch=1000, layout=layout)
        if "--one-header" in flags
        else store_dir(d, dtype, layout=layout)
    )
    warm_cache(path, huge="warm4k" not in sys.argv[4:])
    store = hs.open_store(path)
    columns = [store.tensor(p).view(torch.int16).numpy() for p in points]
    xn = np.concatenate(columns, axis=1)  # numpy: huge pages; a row's columns side by side
    xt = torch.from_numpy(xn)
    ds = store.dataset(point, batch_size=BATCH, buffer_rows=buffer_rows, **({"stack": True} if stack else {}))

    def floor_torch() -> float:
        perm = torch.randperm(rows)
        t0 = time.perf_counter()
        for s in range(0, rows, BATCH):
            torch.index_select(xt, 0, perm[s : s + BATCH])
        return rows / (time.perf_counter() - t0)

    out = torch.from_numpy(np.empty((BATCH, *xt.shape[1:]), xn.dtype))  # floor_out's one batch, faulted once

    def floor_out() -> float:
        perm = torch.randperm(rows)
        t0 = time.perf_counter()
        for s in range(0, rows, BATCH):
            torch.index_select(xt, 0, perm[s : s + BATCH], out=out)
        return rows / (time.perf_counter() - t0)

    def floor_numpy() -> float:
        perm = np.random.permutation(rows)
        t0 = time.perf_counter()
        for s in range(0, rows, BATCH):
            np.take(xn, perm[s : s + BATCH], axis=0, mode="clip")
        return rows / (time.perf_counter() - t0)

    xc = torch.from_numpy(np.concatenate(columns, axis=0))  # the store's layout: each column a block
    out_cols = torch.from_numpy(np.empty((k * BATCH, d), xn.dtype))
    offsets = (torch.arange(k) * rows)[:, None]

    def floor_cols() -> float:  # a stack's gather from that layout, as the reader makes it
        perm = torch.randperm(rows)
        t0 = time.perf_counter()
        for s in range(0, rows, BATCH):
            torch.index_select(xc, 0, (perm[s : s + BATCH] + offsets).reshape(-1), out=out_cols)
        return rows / (time.perf_counter() - t0)

    def epoch() -> float:
        t0 = time.perf_counter()
        n = sum(len(b if isinstance(b, torch.Tensor) else next(iter(b.values()))) for b in ds)
        assert n == rows
        return rows / (time.perf_counter() - t0)

    first = epoch()
    floors, ratios, cols = [], [], []
    for _ in range(rounds):
        floor = max(floor_torch(), floor_numpy(), floor_out())
        floors.append(floor)
        cols.append(floor_cols() if k > 1 else floor)
        rate = epoch()
        ratios.append(rate / floor)
        cols[-1] = rate / cols[-1]
    print(
        f"{hs.__file__} {path.name}: d {d} {dtype}: first epoch {first * k / 1e6:.2f} M point rows/s; "
        f"floor median {statistics.median(floors) * k / 1e6:.2f} M; later epochs / floor median "
        f"{statistics.median(ratios):.3f} (rounds {min(ratios):.2f}-{max(ratios):.2f})"
        + (
            f"; / floor-cols median {statistics.median(cols):.3f} (rounds {min(cols):.2f}-{max(cols):.2f})"
            if k > 1
            else ""
        )
    )


if __name__ == "__main__":
    main()
