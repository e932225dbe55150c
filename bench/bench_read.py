"""Reading a store for training: rows/s and GiB/s against the in-RAM gather floor, before (an
earlier main, `--before-rev`) and after, and SAELens training from a store against SAELens's own
cache of the same activations.

Cases (each measurement in a fresh process; rounds interleave the cases, the order reversed every
other round (ABBA), so load drifts and order effects hit them all; the median of `--runs`
processes; use an even `--runs`):

- floor: the whole column already in RAM (allocated by numpy, which asks for huge pages), gathered
  in a random order in batches of 4,096 with torch's `index_select` (torch's default threads);
  floor-np: the same with numpy's `take` on one thread; floor-out: torch's `index_select` into one
  batch-sized buffer allocated once (no page faults for new batch memory; every batch overwrites the
  last, which a reader cannot do while a consumer holds its batch). The ratio is to the fastest of
  the floors: what a trainer could get with no disk and no file format at all. floor-held: torch's
  `index_select` into a new batch while the last one is still held, as `batch = x[idx]` in a
  training loop does (two batches alive: the in-RAM gather a trainer writes). disk: the shard
  files read front to back with the page cache dropped (the disk's own speed, which bounds every
  cold case: cold cases also show their ratio to it).
- before: `store.dataset(point, batch_size=4096)` of main at `--before-rev` (default 1dec836;
  exported from git into bench/out/read/src-REV, or `--before-src DIR`), in a process whose
  PYTHONPATH puts it first; after: this checkout's. `shuffle=True` unless named `seq`
  (`shuffle=False`).
- loader2: after, through `DataLoader(ds, batch_size=None, num_workers=2)`. after-drop: after, the
  consumer letting go of each batch before asking for the next (as `b = b.to(device)` does), so the
  reader gathers every batch into the same memory.
- warm: shard files in the page cache in 2 MiB pages, as a fresh extraction or an earlier reading
  run leaves them (dropped, then read back through a mapping that asks for huge pages), 3 epochs
  in one pass; warm4k: in the page cache in small pages, as `read()` leaves them (`cp`, `cat`, a
  checksum of a cold store: dropped, then read front to back), 3 epochs; cold: every shard file
  dropped from the page cache with `posix_fadvise(DONTNEED)` (after `fsync`, so the pages are
  clean and really dropped; no root needed) right before a one-epoch pass.

d_model 768 (262,144 rows, 384 MiB) and 4096 (131,072 rows, 1 GiB), float16 and bfloat16, shards
of 16,384 / 4,096 rows, windows (`buffer_rows`) of 65,536 / 16,384 rows.

`--layouts stack,clt`: the same bytes as several points read together: `stack`, 4 layers'
`blocks.L.resid_post` read as `store.dataset("blocks.*.resid_post", stack=True)` ([batch, 4, d],
1/4 of the rows); `clt`, 4 layers' `mlp.in` and `mlp.out` as two stacks from one order (1/8 of the
rows). Their floors gather the same columns from one in-RAM `[rows, columns * d]` tensor (each row's
bytes in one piece, which a reader of separate columns cannot have); floor-cols (stacked layouts
only) gathers them from the layout the store has, each column's rows a block of their own
(`[columns * rows, d]`, numpy-allocated), as the reader gathers a stack: one `index_select` of
columns x 4,096 rows into one layer-major batch buffer allocated once (as floor-out). floor-cols2:
the same into two such buffers in turn, the least batch memory a reader has (its consumer holds a
batch while the next is gathered; floor-cols overwrites the batch it just made). Each case is printed
against the fastest floor and, for stacked layouts, against floor-cols too. `stored` / `stored-clt`:
the same bytes as `hookscope extract --stack` stores them, one column per glob, `[rows, 4, d]`
(each row's layers in one piece), read by name (`store.dataset("blocks.*.resid_post")`); their
floors are stack's and clt's.

`--epochs N` (default 3) sets the warm cases' epochs per process: a larger N weighs the first
epoch (mapping, the first window, batch memory faulted in for the first time) less. `--threads N`
sets torch's threads in every case (default: torch's own); `--clock cpu` times each case by the
process's CPU time (every thread's, the reader's prefetch thread included) instead of the wall
clock: with `--threads 1`, the work each case does, which other jobs on the machine change least.
`--saelens`: SAELens
`SAETrainer.fit` samples/s fed by `iter(store.dataset(..., repeat=True))` against SAELens's
`ActivationsStore` over `hookscope export --format saelens` of the same store.

    .venv/bin/python bench/bench_read.py            # the reading matrix, 4 rounds: ~20 min
    .venv/bin/python bench/bench_read.py --saelens-only   # SAELens samples/s, 4 rounds: ~6 min
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
OUT = BENCH_DIR / "out" / "read"
BATCH = 4096
SHAPES = {
    768: {"rows": 262_144, "shard_rows": 16_384, "buffer_rows": 65_536},
    4096: {"rows": 131_072, "shard_rows": 4_096, "buffer_rows": 16_384},
}
BEFORE_REV = "1dec836"  # main before batch memory was reused (store/dataset.py `_Recycler`)
CASES = [
    ("floor", "warm"),
    ("floor-np", "warm"),
    ("floor-out", "warm"),
    ("floor-held", "warm"),
    ("floor-cols", "warm"),
    ("floor-cols2", "warm"),
    ("after-drop", "warm"),
    ("disk", "cold"),
    ("before", "warm"),
    ("after", "warm"),
    ("before", "warm4k"),
    ("after", "warm4k"),
    ("before-seq", "warm"),
    ("after-seq", "warm"),
    ("loader2", "warm"),
    ("before", "cold"),
    ("after", "cold"),
]
POINT = "blocks.0.resid_post"
STACK_LAYERS = 4
# layout -> (the dataset's `point`, stack=, the store's points)
LAYOUTS = {
    "point": (POINT, False, [POINT]),
    "stack": ("blocks.*.resid_post", True, [f"blocks.{i}.resid_post" for i in range(STACK_LAYERS)]),
    "clt": (
        ["blocks.*.mlp.in", "blocks.*.mlp.out"],
        True,
        [f"blocks.{i}.mlp.{k}" for i in range(STACK_LAYERS) for k in ("in", "out")],
    ),
    # the same as stored by `hookscope extract --stack`: one column per glob, [rows, layers, d]
    "stored": ("blocks.*.resid_post", False, ["blocks.*.resid_post"]),
    "stored-clt": (["blocks.*.mlp.in", "blocks.*.mlp.out"], False, ["blocks.*.mlp.in", "blocks.*.mlp.out"]),
}


def layers_per_column(layout: str) -> int:
    return STACK_LAYERS if layout.startswith("stored") else 1


EPOCHS = 3  # warm cases: 3 epochs by default, --epochs (cold: one epoch, right after dropping the cache)


def store_dir(d: int, dtype: str, quick: bool = False, first_batch: int = 0, layout: str = "point") -> Path:
    one_header = "-one-header" if first_batch else ""
    kind = "" if layout == "point" else f"-{layout}"
    return OUT / f"store-{d}-{dtype}-{SHAPES[d]['rows'] // (8 if quick else 1)}{one_header}{kind}"


def build_store(d: int, dtype: str, quick: bool, first_batch: int = 0, layout: str = "point") -> Path:
    """The benchmark's store of random rows. `first_batch=1000` numbers its batches from 1000, so
    every shard's identity (`batches 1000-1003 of rank 0, ...`) has as many digits as the next and
    every header one length; numbered from 0, shards 0-1 (batches 0-7) have headers 8 bytes shorter,
    which puts their rows off the others' stride (a second run, store/strided.py)."""
    import torch

    from hookscope.store import ShardWriter

    out = store_dir(d, dtype, quick, first_batch, layout)
    if (out / "manifest.json").exists():
        return out
    shape = SHAPES[d]
    points = LAYOUTS[layout][2]
    layers = layers_per_column(layout)
    k = len(points) * layers
    rows = shape["rows"] // (8 if quick else 1) // k  # the same bytes in every layout
    shard_rows = shape["shard_rows"] // k
    g = torch.Generator().manual_seed(0)
    settings = {"bench": "read", "d": d, "dtype": dtype, "rows": rows}
    if first_batch:  # (the default stores keep the settings, and so the bytes, they always had)
        settings["first_batch"] = first_batch
    if layout != "point":
        settings["points"] = points
    with ShardWriter(out, settings, shard_rows=shard_rows) as w:
        per = shard_rows // 4
        for b in range(rows // per):
            row = (layers, d) if layers > 1 else (d,)
            xs = {p: torch.randn(per, *row, generator=g).to(getattr(torch, dtype)) for p in points}
            w.write(first_batch + b, xs, {"token_ids": torch.arange(b * per, (b + 1) * per)})
    return out


def saelens_dir(rows: int) -> Path:
    """SAELens's cached-activations folder exported from the 768 float16 store of `rows` rows."""
    return OUT / f"saelens-768-float16-{rows}"


def drop_cache(path: Path) -> None:
    for f in sorted((path / "shards").glob("*.safetensors")):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(path: Path, huge: bool = True) -> None:
    """Every shard file in the page cache: in 2 MiB pages (read back through a mapping that asks for
    them, as the writer or a reading run leaves a file) or, `huge=False`, in small pages (`read()`)."""
    import ctypes
    import mmap

    import numpy as np

    drop_cache(path)
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for f in sorted((path / "shards").glob("*.safetensors")):
        with open(f, "rb") as fh:
            if not huge:
                while fh.read(1 << 24):
                    pass
                continue
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
                view = np.frombuffer(m, np.uint8)
                libc.madvise(view.ctypes.data, len(view), mmap.MADV_HUGEPAGE)
                int(view[::4096].max())
                del view


def before_src(rev: str) -> Path:
    """`src/` of git revision `rev`, exported once under bench/out/read/."""
    out = OUT / f"src-{rev}"
    if not (out / "src" / "hookscope" / "__init__.py").exists():
        out.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "archive", rev, "src"], cwd=BENCH_DIR.parent, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out / "src"


def measure(
    case: str,
    d: int,
    dtype: str,
    cache: str,
    path: Path,
    layout: str = "point",
    warm_epochs: int = EPOCHS,
    threads: int = 0,
    clock: str = "wall",
) -> dict:
    """One pass over the store at `path` in this process; rows/s (point rows: a stacked row of k
    columns counts k, so that every layout's rows/s is its bytes/s over d * 2)."""
    import numpy as np
    import torch

    import hookscope as hs

    if threads:
        torch.set_num_threads(threads)
    now = time.process_time if clock == "cpu" else time.perf_counter
    store = hs.open_store(path)
    point, stack, points = LAYOUTS[layout]
    k = len(points) * layers_per_column(layout)
    rows = len(store)
    buffer_rows = SHAPES[d]["buffer_rows"] // k // (8 if rows * k < SHAPES[d]["rows"] else 1)
    epochs = 1 if cache == "cold" else warm_epochs
    if case == "disk":  # the disk's own speed: every shard file read front to back, nothing else
        drop_cache(path)
        t0 = now()
        for f in sorted((path / "shards").glob("*.safetensors")):
            with open(f, "rb", buffering=0) as fh:
                while fh.read(1 << 24):
                    pass
        seconds, n = now() - t0, rows * epochs
    elif case.startswith("floor"):
        # in RAM (numpy: huge pages), not mapped; several columns side by side in each row, or (floor-cols)
        # each column's rows in a block of their own, as the store lays them out
        columns = [store.tensor(p).view(torch.int16).numpy().reshape(rows, -1) for p in points]
        by_column = case.startswith("floor-cols")
        xn = np.concatenate(columns, axis=0 if by_column else 1)
        x = torch.from_numpy(xn).view(getattr(torch, dtype))
        # floor-out's / floor-cols' one batch (floor-cols2: two), allocated (and faulted in by its first
        # gather) once
        kept = 2 if case == "floor-cols2" else 1 if case in ("floor-out", "floor-cols") else 0
        outs = [torch.from_numpy(np.empty((BATCH, d * k), np.int16)).view(x.dtype) for _ in range(kept)]
        out = outs[0] if outs else None
        if by_column:  # layer-major: column j's rows of the batch at rows j*BATCH.. of the buffer
            outs, offsets = [o.view(k * BATCH, d) for o in outs], (torch.arange(k) * rows)[:, None]
        t0 = now()
        n = 0
        for _ in range(epochs):
            perm = torch.randperm(rows)
            for s in range(0, rows, BATCH):
                if case == "floor":
                    n += torch.index_select(x, 0, perm[s : s + BATCH]).shape[0]
                elif case == "floor-out":  # into memory faulted in once (rows divide into batches)
                    n += torch.index_select(x, 0, perm[s : s + BATCH], out=out).shape[0]
                elif case == "floor-held":  # `batch = x[idx]` in a loop: the last batch held meanwhile
                    held = torch.index_select(x, 0, perm[s : s + BATCH])
                    n += held.shape[0]
                elif by_column:  # every column's rows of the batch, in one gather
                    index = (perm[s : s + BATCH] + offsets).reshape(-1)
                    n += torch.index_select(x, 0, index, out=outs[s // BATCH % len(outs)]).shape[0] // k
                else:
                    index = perm[s : s + BATCH].numpy()
                    n += np.take(xn, index, axis=0, mode="clip").shape[0]  # a new batch, as a reader makes
        seconds = now() - t0
    else:
        ds = store.dataset(
            point,
            shuffle=not case.endswith("-seq"),
            batch_size=BATCH,
            buffer_rows=buffer_rows,
            **({"stack": True} if stack else {}),
        )
        if case == "loader2":
            ds = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
        if cache == "cold":
            drop_cache(path)
        else:
            warm_cache(path, huge=cache == "warm")
        t0 = now()
        n = 0
        for _ in range(epochs):  # each pass over the dataset is the next epoch (a new order)
            batches = iter(ds)
            while (batch := next(batches, None)) is not None:  # `for batch in ds`, unrolled
                n += (batch if isinstance(batch, torch.Tensor) else next(iter(batch.values()))).shape[0]
                if case == "after-drop":
                    del batch  # let go before asking for the next (the reader may reuse its memory)
        seconds = now() - t0
    assert n == rows * epochs, (n, rows)
    n *= k
    return {"rows_per_s": n / seconds, "gib_per_s": n * d * 2 / seconds / 2**30, "hookscope": hs.__file__}


def measure_saelens(source: str, steps: int, train: bool = True) -> dict:
    import torch
    from sae_lens import SAETrainer, StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.activations_store import ActivationsStore

    import hookscope as hs
    from hookscope.export import saelens_config

    torch.set_num_threads(2)
    torch.manual_seed(0)
    store = hs.open_store(store_dir(768, "float16"))
    if source == "hookscope":
        data = iter(store.dataset(POINT, batch_size=BATCH, drop_last=True, repeat=True, buffer_rows=65_536))
    else:
        cache = saelens_config(saelens_dir(len(store)))
        data = ActivationsStore(
            model=None,
            dataset=None,
            streaming=False,
            hook_name=cache.hook_name,
            hook_head_index=None,
            context_size=cache.context_size,
            d_in=cache.d_in,
            n_batches_in_buffer=64,
            total_training_tokens=10**9,
            store_batch_size_prompts=BATCH // cache.context_size,
            train_batch_size_tokens=BATCH,
            prepend_bos=False,
            normalize_activations="none",
            device=torch.device("cpu"),
            dtype="float32",
            cached_activations_path=cache.path,
        )
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=768, d_sae=1536))
    cfg = SAETrainerConfig(
        total_training_samples=steps * BATCH, train_batch_size_samples=BATCH, lr=1e-4, lr_end=1e-4
    )
    batch = next(data)  # the first read (opening, first window) is not what this measures
    if not train:  # the data path alone: batches as SAETrainer.step receives them
        t0 = time.perf_counter()
        for _ in range(steps):
            next(data).to(torch.float32)
        return {"samples_per_s": steps * BATCH / (time.perf_counter() - t0)}
    trainer = SAETrainer(cfg, sae, data)
    trainer.step(batch.float())
    trainer.n_training_samples = 0
    t0 = time.perf_counter()
    trainer.fit()
    seconds = time.perf_counter() - t0
    return {"samples_per_s": steps * BATCH / seconds}


def fresh(args: list[str], src: Path | None = None) -> dict:
    env = dict(os.environ)
    if src is not None:  # this hookscope first on the path (ahead of the editable install)
        env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = subprocess.run(
        [sys.executable, __file__, "--one", *args], check=True, capture_output=True, text=True, env=env
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if src is not None and "hookscope" in result:
        assert result["hookscope"].startswith(str(src)), (result["hookscope"], src)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="1/8 of the rows (a smoke run)")
    p.add_argument("--saelens", action="store_true", help="also SAELens training samples/s")
    p.add_argument("--saelens-only", action="store_true")
    p.add_argument("--steps", type=int, default=16, help="SAELens training steps per run")
    p.add_argument("--before-rev", default=BEFORE_REV, help="git revision whose src/ is 'before'")
    p.add_argument(
        "--before-src",
        type=Path,
        help="src/ of the 'before' checkout (default: --before-rev, exported from git)",
    )
    p.add_argument("--cases", default=",".join(f"{c}/{k}" for c, k in CASES))
    p.add_argument("--dims", default="768,4096")
    p.add_argument("--dtypes", default="float16,bfloat16")
    p.add_argument("--layouts", default="point", help="point,stack,clt,stored,stored-clt (see the docstring)")
    p.add_argument("--epochs", type=int, default=EPOCHS, help="epochs per process in the warm cases")
    p.add_argument("--threads", type=int, default=0, help="torch's threads in every case (0: torch's own)")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="time each case by the wall clock or by the process's CPU time",
    )
    p.add_argument("--one", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # progress shows when redirected to a file
    if args.one:
        kind, *rest = args.one
        if kind == "read":
            case, d, dtype, cache, path, layout, epochs, threads, clock = rest
            print(
                json.dumps(
                    measure(case, int(d), dtype, cache, Path(path), layout, int(epochs), int(threads), clock)
                )
            )
        elif kind == "build":  # the store alone, written by this process's hookscope (before_after.py)
            d, dtype = rest
            print(json.dumps({"path": str(build_store(int(d), dtype, quick=False))}))
        else:
            print(json.dumps(measure_saelens(rest[0], int(rest[1]), rest[2] == "train")))
        return
    OUT.mkdir(parents=True, exist_ok=True)
    print(f"load before: {open('/proc/loadavg').read().split()[:3]}")
    results = {}
    dims = [int(x) for x in args.dims.split(",")]
    dtypes = args.dtypes.split(",")
    before = args.before_src or before_src(args.before_rev)
    # this process writes the stores with the "before" tree, so both trees read them (a tree before
    # elastic resume reads format 1 only; a store written earlier, by 667a82f, is format 1 and kept)
    sys.path.insert(0, str(before))
    cases = [tuple(c.split("/")) for c in args.cases.split(",")]
    if not args.saelens_only:
        layouts = args.layouts.split(",")
        for layout, d, dtype in [(lay, d, t) for lay in layouts for d in dims for t in dtypes]:
            path = build_store(d, dtype, args.quick, layout=layout)
            runs: dict[str, list[dict]] = {}
            for r in range(args.runs):  # rounds: every case once per round, fresh processes, the
                # order reversed every other round (ABBA): a cold read right after another cold read
                # measured slower here (whichever came second), so no case may always come second
                for case, cache in cases if r % 2 == 0 else cases[::-1]:
                    if case.startswith("floor-cols") and (layout == "point" or layout.startswith("stored")):
                        continue  # one column (or row-major stacks): floor-out
                    src = before if case.startswith("before") else None
                    one = [
                        "read",
                        case,
                        str(d),
                        dtype,
                        cache,
                        str(path),
                        layout,
                        str(args.epochs),
                        str(args.threads),
                        args.clock,
                    ]
                    runs.setdefault(f"{case}/{cache}", []).append(fresh(one, src))
            row = {k: statistics.median(r["rows_per_s"] for r in v) for k, v in runs.items()}
            floor = max((v for k, v in row.items() if k.startswith("floor")), default=float("nan"))
            disk, cols = row.get("disk/cold"), row.get("floor-cols/warm")
            print(
                f"\n{layout}: d_model {d}, {dtype}, {args.epochs} warm epochs, threads "
                f"{args.threads or 'default'}, {args.clock} clock (load now "
                f"{os.getloadavg()[0]:.1f}): rows/s, ratio to the fastest in-RAM floor"
                + (" and to floor-cols (the store's layout)" if cols else "")
            )
            for key, value in row.items():
                gib = statistics.median(r["gib_per_s"] for r in runs[key])
                each = [round(r["rows_per_s"] / 1e6, 3) for r in runs[key]]
                vs_disk = f" ({value / disk:4.2f}x disk)" if disk and key.endswith("/cold") else ""
                vs_cols = f" {value / cols:5.2f}x cols" if cols and key.endswith("/warm") else ""
                print(
                    f"  {key:18s} {value / 1e6:7.3f} M rows/s  {gib:6.2f} GiB/s  "
                    f"{value / floor:5.2f}x{vs_cols}{vs_disk}  runs {each}"
                )
            results[f"{d}-{dtype}" + ("" if layout == "point" else f"-{layout}")] = {
                "median_rows_per_s": row,
                "floor": floor,
                "epochs": args.epochs,
                "runs": runs,
            }
    if args.saelens or args.saelens_only:
        import hookscope as hs
        from hookscope.export import export_saelens

        build_store(768, "float16", False)
        cache = saelens_dir(len(hs.open_store(store_dir(768, "float16"))))
        if not (cache / "state.json").exists():
            export_saelens(hs.open_store(store_dir(768, "float16")), cache, context_size=128, progress=False)
        rates: dict[str, list[float]] = {}
        for r in range(args.runs):  # alternate, the order reversed every other round (ABBA)
            for source in ("hookscope", "saelens-cache")[:: 1 if r % 2 == 0 else -1]:
                for what, steps in (("train", args.steps), ("data", 8 * args.steps)):
                    rate = fresh(["saelens", source, str(steps), what])["samples_per_s"]
                    rates.setdefault(f"{source}/{what}", []).append(rate)
        med = {k: statistics.median(v) for k, v in rates.items()}
        print(
            f"\nSAELens SAETrainer.fit, d_in 768 -> 1536, batches of {BATCH}, {args.steps} steps (train), "
            "or the batches alone (data): samples/s"
        )
        for k, v in rates.items():
            print(f"  {k:20s} median {med[k]:11,.0f}  runs {[round(x) for x in v]}")
        for what in ("train", "data"):
            print(
                f"  ratio hookscope / SAELens cache, {what}: "
                f"{med[f'hookscope/{what}'] / med[f'saelens-cache/{what}']:.2f}x"
            )
        results["saelens"] = rates
    print(f"load after: {open('/proc/loadavg').read().split()[:3]}")
    (OUT / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
