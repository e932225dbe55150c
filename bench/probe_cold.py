"""Cold reading: does advising the kernel before the reading thread touches a window help?

The shuffled dataset's background thread brings each window in by touching one byte per 64 KiB of
its mapped shards (store/mapper.py `populate`), which makes the kernel read the files front to
back. This probe times one cold epoch (page cache dropped, as bench_read.py's cold case) and the
two epochs after it, each in a fresh process, with `_populate` preceded by nothing (`touch`, what
the reader does), `MADV_HUGEPAGE` (2 MiB folios read per fault), `MADV_WILLNEED` (the whole range
queued for asynchronous readahead) or both; `disk` is the files read front to back with `read()`.
Rounds alternate the order (ABBA); the medians are printed in M rows/s.

    .venv/bin/python bench/probe_cold.py 768 float16 6      # needs the stores bench_read.py builds
"""

from __future__ import annotations

import ctypes
import json
import statistics
import subprocess
import sys
import time

import bench_read as br

MADV_WILLNEED, MADV_HUGEPAGE = 3, 14
ADVICE = {
    "disk": [],
    "touch": [],
    "huge": [MADV_HUGEPAGE],
    "willneed": [MADV_WILLNEED],
    "huge+willneed": [MADV_HUGEPAGE, MADV_WILLNEED],
}


def one(method: str, d: int, dtype: str) -> dict[str, float]:
    import hookscope as hs
    import hookscope.store.mapper as mapper

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    touch = mapper.populate

    def advise_then_touch(t):
        if t.numel():
            start = t.data_ptr() & ~4095
            for advice in ADVICE[method]:
                if libc.madvise(start, t.data_ptr() + t.numel() * t.element_size() - start, advice):
                    raise OSError(ctypes.get_errno(), "madvise")
        touch(t)

    mapper.populate = advise_then_touch
    path = br.store_dir(d, dtype)
    store = hs.open_store(path)
    br.drop_cache(path)
    if method == "disk":
        t0 = time.perf_counter()
        for f in sorted((path / "shards").glob("*.safetensors")):
            with open(f, "rb", buffering=0) as fh:
                while fh.read(1 << 24):
                    pass
        return {"cold": len(store) / (time.perf_counter() - t0)}
    ds = store.dataset(br.POINT, batch_size=br.BATCH, buffer_rows=br.SHAPES[d]["buffer_rows"])
    out = {}
    for key in ("cold", "next1", "next2"):  # each pass over the dataset is the next epoch
        t0 = time.perf_counter()
        n = sum(batch.shape[0] for batch in ds)
        out[key] = n / (time.perf_counter() - t0)
    return out


def main() -> None:
    if sys.argv[1] == "--one":
        print(json.dumps(one(sys.argv[2], int(sys.argv[3]), sys.argv[4])))
        return
    d, dtype, rounds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    br.build_store(d, dtype, False)
    results: dict[str, list[dict]] = {m: [] for m in ADVICE}
    for r in range(rounds):
        for method in list(ADVICE) if r % 2 == 0 else list(ADVICE)[::-1]:
            out = subprocess.run(
                [sys.executable, __file__, "--one", method, str(d), dtype],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            results[method].append(json.loads(out.strip().splitlines()[-1]))
            print(r, method, {k: round(v / 1e6, 3) for k, v in results[method][-1].items()}, flush=True)
    print(f"{d} {dtype}, median of {rounds}, M rows/s:")
    for method, runs in results.items():
        print(
            f"  {method}: "
            + ", ".join(f"{k} {statistics.median(x[k] for x in runs) / 1e6:.3f}" for k in runs[0])
        )


if __name__ == "__main__":
    main()
