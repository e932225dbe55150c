"""Extraction to a store at a URL (a local S3-compatible server) vs to a local directory, and
reading it back (issue 18). Every run is a fresh process; local and S3 runs alternate.

    .venv/bin/python bench/bench_store_url.py --runs 3 --max-tokens 40000

The S3 server is moto's standalone server on a free 127.0.0.1 port, started and stopped here
(`pip install 'moto[server]' s3fs`). It runs in-process Python: a slow S3, not a fast one, so the
ratio is a floor for what a real object store with spare bandwidth gives.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXTRACT = ["--points", "blocks.3.resid_post", "--context", "128", "--batch-size", "8", "--dtype", "float16",
           "--shard-rows", "4096", "--no-progress"]
READ = """
import sys, time
from hookscope.store import open_store
t = time.perf_counter()
store = open_store(sys.argv[1])
rows = 0
for i in range(store.num_shards):
    rows += store.load_shard(i, ["blocks.3.resid_post"])["blocks.3.resid_post"].float().sum(1).shape[0]
print(rows / (time.perf_counter() - t))
"""


def start_s3() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit("the moto server did not start")


def extract_rate(out: str, max_tokens: int, env: dict[str, str]) -> float:
    run = subprocess.run([sys.executable, "-m", "hookscope.cli", "extract", "--out", out, "--max-tokens",
                          str(max_tokens), *EXTRACT], capture_output=True, text=True, env=env, check=True)
    m = re.search(r"wrote ([\d,]+) rows in ([\d.]+) s", run.stdout)
    return int(m.group(1).replace(",", "")) / float(m.group(2))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=40000)
    args = parser.parse_args()
    server, endpoint = start_s3()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}
    os.environ.update(env)
    import s3fs

    s3fs.S3FileSystem().mkdir("bench")
    tmp = Path(tempfile.mkdtemp(prefix="hookscope-bench-"))
    result: dict[str, list[float]] = {"local": [], "s3": [], "read_local": [], "read_s3": []}
    try:
        for i in range(args.runs):
            local, url = str(tmp / f"local{i}"), f"s3://bench/store{i}"
            result["local"].append(extract_rate(local, args.max_tokens, env))
            result["s3"].append(extract_rate(url, args.max_tokens, env))
            for key, where in (("read_local", local), ("read_s3", url)):
                out = subprocess.run([sys.executable, "-c", READ, where], capture_output=True, text=True,
                                     env=env, check=True)
                result[key].append(float(out.stdout.strip()))
            print(f"run {i}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in result.items())
                  + f"; load {Path('/proc/loadavg').read_text().split()[:3]}", flush=True)
            shutil.rmtree(local)
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in result.items()}
    print(json.dumps({"runs": result, "median": med,
                      "extract_s3_over_local": med["s3"] / med["local"],
                      "read_s3_over_local": med["read_s3"] / med["read_local"],
                      "loadavg": Path("/proc/loadavg").read_text().split()[:3]}, indent=1))


if __name__ == "__main__":
    main()
