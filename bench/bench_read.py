"""Reading a store for training: rows/s and GiB/s against the in-RAM gather floor, and SAELens
training from a store against SAELens's own cache of the same activations.

Cases (each measurement in a fresh process, the median of `--runs` processes):

- floor: the whole column already in RAM, gathered in a random order in batches of 4,096
  (`index_select`): what a trainer could get with no disk and no file format at all.
- before: the dataset as it was before issue 17 (each window loaded when reached, batches joined
  with `torch.cat`), loaded from git history (`--before-rev`).
- after: `store.dataset(point, batch_size=4096)` with `shuffle=True` (the next window read in a
  background thread); `sequential`: `shuffle=False`; `loader1`: after, through a `DataLoader`
  with one worker process (`batch_size=None`).
- warm: shard files in the page cache (read once before), 3 epochs in one pass; cold: every
  shard file dropped from the page cache with `posix_fadvise(DONTNEED)` right before the pass
  (the files are fsynced by the
  writer, so their pages are clean and really dropped).

For d_model 768 and 4096, float16 and bfloat16. Each store holds 384-512 MiB in 16 shards, read
in 4 windows. `--saelens`: SAELens `SAETrainer.fit` samples/s fed by `iter(store.dataset(...,
repeat=True))` against SAELens's `ActivationsStore` over `hookscope export --format saelens` of
the same store (SAELens's own reader: `datasets` + its mixing buffer).

    .venv/bin/python bench/bench_read.py [--runs 3] [--quick] [--saelens]
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
SHAPES = {768: {"rows": 262_144, "shard_rows": 16_384, "buffer_rows": 65_536},
          4096: {"rows": 65_536, "shard_rows": 4_096, "buffer_rows": 16_384}}
POINT = "blocks.0.resid_post"
EPOCHS = 3  # warm cases: steady state over 3 epochs (cold: one epoch, right after dropping the cache)


def store_dir(d: int, dtype: str) -> Path:
    return OUT / f"store-{d}-{dtype}"


def build_store(d: int, dtype: str, quick: bool) -> Path:
    import torch

    from hookscope.store import ShardWriter

    out = store_dir(d, dtype)
    if (out / "manifest.json").exists():
        return out
    shape = SHAPES[d]
    rows = shape["rows"] // (8 if quick else 1)
    g = torch.Generator().manual_seed(0)
    with ShardWriter(out, {"bench": "read", "d": d, "dtype": dtype, "rows": rows},
                     shard_rows=shape["shard_rows"]) as w:
        per = shape["shard_rows"] // 4
        for b in range(rows // per):
            x = torch.randn(per, d, generator=g).to(getattr(torch, dtype))
            w.write(b, {POINT: x}, {"token_ids": torch.arange(b * per, (b + 1) * per)})
    return out


def drop_cache(path: Path) -> None:
    for f in sorted((path / "shards").glob("*.safetensors")):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_cache(path: Path) -> None:
    for f in sorted((path / "shards").glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


def old_dataset_class(rev: str):
    """The ActivationDataset of git revision `rev`, imported from its source."""
    import importlib.util

    src = subprocess.run(["git", "show", f"{rev}:src/hookscope/store/dataset.py"], cwd=BENCH_DIR.parent,
                         check=True, capture_output=True, text=True).stdout
    src = src.replace("from ..errors import", "from hookscope.errors import")
    path = OUT / f"dataset_{rev}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"dataset_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ActivationDataset


def measure(case: str, d: int, dtype: str, cache: str, before_rev: str) -> dict:
    """One pass over the store in this process; rows/s."""
    import torch

    import hookscope as hs

    torch.set_num_threads(2)
    path = store_dir(d, dtype)
    store = hs.open_store(path)
    rows = len(store)
    buffer_rows = SHAPES[d]["buffer_rows"] // (8 if rows < SHAPES[d]["rows"] else 1)
    epochs = 1 if cache == "cold" else EPOCHS
    if case == "floor":
        x = store.tensor(POINT).clone()  # in RAM, not mapped
        t0 = time.perf_counter()
        n = 0
        for _ in range(epochs):
            perm = torch.randperm(rows)
            for s in range(0, rows, BATCH):
                n += torch.index_select(x, 0, perm[s : s + BATCH]).shape[0]
        seconds = time.perf_counter() - t0
    else:
        if case == "before":
            old = old_dataset_class(before_rev)
            ds = old(store, POINT, shuffle=True, batch_size=BATCH, buffer_rows=buffer_rows)
        else:
            ds = store.dataset(POINT, shuffle=case != "sequential", batch_size=BATCH, buffer_rows=buffer_rows)
        if case == "loader1":
            ds = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1)
        (drop_cache if cache == "cold" else warm_cache)(path)
        t0 = time.perf_counter()
        n = 0
        for _ in range(epochs):  # each pass over the dataset is the next epoch (a new order)
            for batch in ds:
                n += batch.shape[0]
        seconds = time.perf_counter() - t0
    assert n == rows * epochs, (n, rows)
    return {"rows_per_s": n / seconds, "gib_per_s": n * d * 2 / seconds / 2**30}


def measure_saelens(source: str, steps: int) -> dict:
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
        cache = saelens_config(OUT / "saelens-768-float16")
        data = ActivationsStore(
            model=None, dataset=None, streaming=False, hook_name=cache.hook_name, hook_head_index=None,
            context_size=cache.context_size, d_in=cache.d_in, n_batches_in_buffer=64,
            total_training_tokens=10**9, store_batch_size_prompts=BATCH // cache.context_size,
            train_batch_size_tokens=BATCH, prepend_bos=False, normalize_activations="none",
            device=torch.device("cpu"), dtype="float32", cached_activations_path=cache.path)
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=768, d_sae=1536))
    cfg = SAETrainerConfig(total_training_samples=steps * BATCH, train_batch_size_samples=BATCH, lr=1e-4,
                           lr_end=1e-4)
    batch = next(data)  # the first read (opening, first window) is not what this measures
    trainer = SAETrainer(cfg, sae, data)
    trainer.step(batch.float())
    trainer.n_training_samples = 0
    t0 = time.perf_counter()
    trainer.fit()
    seconds = time.perf_counter() - t0
    return {"samples_per_s": steps * BATCH / seconds}


def fresh(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", *args], check=True, capture_output=True,
                         text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="1/8 of the rows (a smoke run)")
    p.add_argument("--saelens", action="store_true", help="also SAELens training samples/s")
    p.add_argument("--saelens-only", action="store_true")
    p.add_argument("--steps", type=int, default=24, help="SAELens training steps per run")
    p.add_argument("--before-rev", default="75a6189", help="git revision of the dataset before issue 17")
    p.add_argument("--dims", default="768,4096")
    p.add_argument("--dtypes", default="float16,bfloat16")
    p.add_argument("--one", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        kind, *rest = args.one
        if kind == "read":
            case, d, dtype, cache, rev = rest
            print(json.dumps(measure(case, int(d), dtype, cache, rev)))
        else:
            print(json.dumps(measure_saelens(rest[0], int(rest[1]))))
        return
    sys.path.insert(0, str(BENCH_DIR.parent / "src"))
    OUT.mkdir(parents=True, exist_ok=True)
    print(f"load before: {open('/proc/loadavg').read().split()[:3]}")
    results = {}
    dims = [int(x) for x in args.dims.split(",")]
    dtypes = args.dtypes.split(",")
    if not args.saelens_only:
        for d in dims:
            for dtype in dtypes:
                build_store(d, dtype, args.quick)
                row = {}
                cases = [("floor", "warm"), ("before", "warm"), ("after", "warm"), ("sequential", "warm"),
                         ("loader1", "warm"), ("before", "cold"), ("after", "cold")]
                for case, cache in cases:
                    one = ["read", case, str(d), dtype, cache, args.before_rev]
                    runs = [fresh(one) for _ in range(args.runs)]
                    row[f"{case}/{cache}"] = statistics.median(r["rows_per_s"] for r in runs)
                    row[f"{case}/{cache} GiB/s"] = statistics.median(r["gib_per_s"] for r in runs)
                floor = row["floor/warm"]
                print(f"\nd_model {d}, {dtype}: rows/s (ratio to the in-RAM floor)")
                for key, value in row.items():
                    if not key.endswith("GiB/s"):
                        print(f"  {key:18s} {value / 1e6:7.3f} M rows/s  {row[key + ' GiB/s']:6.2f} GiB/s  "
                              f"{value / floor:5.2f}x")
                results[f"{d}-{dtype}"] = row
    if args.saelens or args.saelens_only:
        import hookscope as hs
        from hookscope.export import export_saelens

        build_store(768, "float16", args.quick)
        cache = OUT / "saelens-768-float16"
        if not (cache / "state.json").exists():
            export_saelens(hs.open_store(store_dir(768, "float16")), cache, context_size=128, progress=False)
        rates = {}
        for _ in range(args.runs):  # alternate, so load drifts hit both
            for source in ("hookscope", "saelens-cache"):
                rate = fresh(["saelens", source, str(args.steps)])["samples_per_s"]
                rates.setdefault(source, []).append(rate)
        med = {k: statistics.median(v) for k, v in rates.items()}
        print(f"\nSAELens SAETrainer.fit, d_in 768 -> 1536, batches of {BATCH}, {args.steps} steps: "
              "samples/s")
        for k, v in rates.items():
            print(f"  {k:14s} median {med[k]:9,.0f}  runs {[round(x) for x in v]}")
        print(f"  ratio hookscope / SAELens cache: {med['hookscope'] / med['saelens-cache']:.2f}x")
        results["saelens"] = rates
    print(f"load after: {open('/proc/loadavg').read().split()[:3]}")
    (OUT / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
