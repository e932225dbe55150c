"""What a store's per-dimension statistics cost where they live now (each shard's header) against
where they lived before (every manifest entry): the manifest's size and one entry's, `open_store`,
and the first `store.stats[point]` (every shard's header read, checked and merged), with the
merged mean's largest error against a float64 recomputation from the stored rows, in standard
deviations.

    PYTHONPATH=src .venv/bin/python bench/bench_store_stats.py DIR [SHARDS] [WIDTH]

DIR is made on the first run (SHARDS one-batch shards of 4 bfloat16 rows of WIDTH, default 1000
and 768) and reused after: run it in several fresh processes and take the median. Run it with
another checkout's src on PYTHONPATH (and another DIR) for the figures before.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from hookscope.store import ShardWriter, open_store

out = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 1000
d = int(sys.argv[3]) if len(sys.argv) > 3 else 768
if not os.path.exists(out):
    with ShardWriter(out, {"bench": "store stats"}, shard_rows=4) as w:
        for b in range(n):
            w.write(b, {"p": torch.randn(4, d).to(torch.bfloat16)}, {"token_ids": torch.arange(4)})
raw = json.loads(open(f"{out}/manifest.json").read())
t0 = time.perf_counter()
store = open_store(out)
t1 = time.perf_counter()
st = store.stats["p"]
t2 = time.perf_counter()
x = store.tensor("p").double()
err = float(((st.mean - x.mean(0)).abs() / x.std(0, correction=0)).max())
print(
    json.dumps(
        {
            "shards": n,
            "width": d,
            "manifest_bytes": os.path.getsize(f"{out}/manifest.json"),
            "entry_bytes": len(json.dumps(raw["shards"][0])),
            "open_s": round(t1 - t0, 3),
            "stats_s": round(t2 - t1, 3),
            "mean_error_in_std": err,
            "load": os.getloadavg()[0],
        }
    )
)
