"""Reading a store at a URL (a local S3-compatible server) vs a local directory, before and after
ranged reads (issue 18 item 2); optionally, extraction to the URL vs to a directory (item 1).

    .venv/bin/python bench/bench_store_url.py            # reads, moto and s3rver: ~4 min on 2 loaded cores
    .venv/bin/python bench/bench_store_url.py --servers moto --extract-runs 3   # + extraction, moto only

Reads: one synthetic store (seeded random bfloat16 rows; two points of d 1024, `a` and `b`, plus the
four int64 meta columns extraction writes; 4,096-row shards of ~16.1 MiB, 8 shards) is written to a
local directory and copied object for object to each S3 server. Point `a` is read
  - seq: every shard in order (`store.load_shard(i, ["a"])`), summing each;
  - shuffled: `store.dataset("a", batch_size=1024, buffer_rows=16384)` (windows of 4 shards), one
    epoch, summing each batch;
with the code of this tree ("after") and of the commit named by --before (default: the commit
before ranged reads, which downloaded whole shards into a local cache; taken with `git archive`).
Each round runs one fresh process per code version, which reads local / each server / local ...
alternately, every read through a freshly opened store (so no cache is reused), and the rounds
alternate the two versions: load falls on all alike. Figures are medians over rounds; ratios are of
medians. Rates count the reading only (the store already open); the open time is printed beside.

Two S3-compatible servers on free 127.0.0.1 ports, started and stopped here, both on the same
cores, neither a real object store:
  - moto's standalone server (`moto[server]`, in the dev extra): in-process Python that answers a
    ranged GET by reading and copying the WHOLE object and then slicing it (moto/s3/responses.py
    `_handle_range_header`), so every ranged GET costs a full-object read on the server;
  - s3rver 3.7.1 (Node; objects in files, ranges streamed from the file), installed with npm into
    bench/out/s3rver on first use; skipped when `npm` is missing.

Extraction (`--extract-runs N`, moto only; `--runs 0` skips the reads): `hookscope extract` of the
bundled MiniLM into a local directory, into s3:// with this tree (shards uploaded in the background,
in parts), and into s3:// with the tree of --extract-before (the writer thread uploaded each shard
itself, one PUT), each a fresh process, the order rotating per round; tokens/s as the run reports
it (its clock stops after the last shard is committed). Two cases: `model` (blocks.3, 4,096-row
shards of 3.2 MB: the model sets the pace) and `bytes` (blocks.0, 16,384-row shards of 13 MB in
8 MiB parts: 16 batches a shard, so a shard's upload is long beside the batches the queue holds).
Beside them, moto's own rate: one 13 MB object PUT whole, and in two parts at once.
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
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BEFORE = "667a82f"  # main before ranged reads: a remote shard was downloaded whole, then memory-mapped
S3RVER = REPO / "bench" / "out" / "s3rver"
POINT_DIM, SHARD_ROWS = 1024, 4096
EXTRACT = [
    "--points",
    "blocks.3.resid_post",
    "--context",
    "128",
    "--batch-size",
    "8",
    "--dtype",
    "float16",
    "--shard-rows",
    "4096",
    "--no-progress",
]
EXTRACT_BEFORE = "78ee847"  # main before background uploads: the writer thread uploaded each shard itself
# the paced writer: batches, rows, width, seconds a batch (--pace), rows a shard: 12 shards of 25 MB
PACE = (192, 1024, 768, 0.1, 16384)
# case -> (the command's options, its environment, tokens): model-bound, and where the bytes weigh
CASES = {
    "model": (EXTRACT, {}, 40000),
    "bytes": (
        ["--points", "blocks.0.resid_post", *EXTRACT[2:9], "16384", "--no-progress"],
        {"HOOKSCOPE_UPLOAD_PART_BYTES": str(8 << 20)},
        65536,
    ),
    # the writer alone, fed at a GPU's pace (16 MB/s at 0.1 s a batch): no model on the cores;
    # shards in one PUT each (the default 100 MiB parts), and in 8 MiB parts
    "paced": (["paced"], {}, PACE[0] * PACE[1]),
    "paced-parts": (["paced"], {"HOOKSCOPE_UPLOAD_PART_BYTES": str(8 << 20)}, PACE[0] * PACE[1]),
}
# argv: JSON list of [name, where, endpoint or "", mode]; prints one JSON list of results
READ = """
import json, os, sys, time
import torch
torch.set_num_threads(2)
from hookscope.store import open_store
out = []
for name, where, endpoint, mode in json.loads(sys.argv[1]):
    if endpoint:  # each server has its own endpoint; s3fs reads it from the environment
        import s3fs
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        s3fs.S3FileSystem.clear_instance_cache()
    t0 = time.perf_counter()
    store = open_store(where)
    t1 = time.perf_counter()
    rows = 0
    if mode == "seq":
        for i in range(store.num_shards):
            a = store.load_shard(i, ["a"])["a"]
            a.float().sum()
            rows += len(a)
    else:
        for batch in store.dataset("a", batch_size=1024, buffer_rows=16384, seed=0):
            batch.float().sum()
            rows += len(batch)
    t2 = time.perf_counter()
    assert rows == len(store), (rows, len(store))
    # counted by the ranged reader only (store.fs at a URL; store.remote before the one filesystem interface)
    fs = getattr(store, "fs", None)
    reads = fs if getattr(fs, "remote", False) else getattr(store, "remote", None)
    fetched = getattr(reads, "bytes_read", None)
    out.append({"name": name, "open_s": t1 - t0, "rows_per_s": rows / (t2 - t1),
                "mib_fetched": None if fetched is None else fetched / 2**20})
    del store
print(json.dumps(out))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(server: subprocess.Popen, port: int, what: str) -> None:
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if server.poll() is not None:
                break
            time.sleep(0.2)
    server.kill()
    raise SystemExit(f"{what} did not start")


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for(server, port, "the moto server")
    return server, f"http://127.0.0.1:{port}"


def start_s3rver(data: Path) -> tuple[subprocess.Popen, str] | None:
    exe = S3RVER / "node_modules" / ".bin" / "s3rver"
    if not exe.exists():
        if shutil.which("npm") is None:
            print("no npm: s3rver skipped", flush=True)
            return None
        subprocess.run(
            ["npm", "install", "--prefix", str(S3RVER), "--no-audit", "--no-fund", "s3rver@3.7.1"],
            check=True,
            capture_output=True,
        )
    port = free_port()
    server = subprocess.Popen(
        [str(exe), "-d", str(data), "-a", "127.0.0.1", "-p", str(port), "-s", "--no-vhost-buckets"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for(server, port, "s3rver")
    return server, f"http://127.0.0.1:{port}"


def write_store(out: Path, shards: int) -> None:
    import torch

    from hookscope.store import ShardWriter

    gen = torch.Generator().manual_seed(0)
    rows = SHARD_ROWS // 4  # four batches a shard
    with ShardWriter(out, {"bench": "store_url", "shards": shards}, shard_rows=SHARD_ROWS) as w:
        for i in range(4 * shards):
            points = {p: torch.randn(rows, POINT_DIM, generator=gen).to(torch.bfloat16) for p in ("a", "b")}
            meta = {
                k: torch.arange(rows) + i * rows for k in ("token_ids", "doc_ids", "positions", "seq_ids")
            }
            w.write(i, points, meta)


def write_paced(out: str, pace: float) -> None:
    """Feed a ShardWriter as a GPU would: each batch of float16 rows takes `pace` s to compute (a
    sleep: the cores stay free, as beside a GPU), and time the writer holds the loop up is lost;
    print rows/s, the clock stopped once all is committed."""
    import torch

    from hookscope.store import ShardWriter

    batches, rows, width, _, shard_rows = PACE
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(0)).half()
    t0 = time.perf_counter()
    with ShardWriter(out, {"bench": "paced"}, shard_rows=shard_rows) as w:
        for i in range(batches):
            time.sleep(pace)  # the batch's compute
            ids = torch.arange(i * rows, (i + 1) * rows)
            w.write(i, {"a": x.clone()}, {"token_ids": ids, "doc_ids": ids, "positions": ids, "seq_ids": ids})
    print(batches * rows / (time.perf_counter() - t0))


def checkout(ref: str, into: Path) -> Path:
    """The `src` tree of commit `ref`, extracted under `into`."""
    run = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", ref, "src"], capture_output=True, check=True
    )
    with tarfile.open(fileobj=BytesIO(run.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def read_round(src: Path, reads: list[list[str]], env: dict[str, str]) -> list[dict]:
    run = subprocess.run(
        [sys.executable, "-c", READ, json.dumps(reads)],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(src)},
        check=False,
    )
    if run.returncode:
        raise SystemExit(f"{src}: a read failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def extract_rate(out: str, max_tokens: int, options: list[str], env: dict[str, str]) -> float:
    if options == ["paced"]:
        run = subprocess.run(
            [sys.executable, __file__, "--paced", out, "--pace", env["PACE"]],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if run.returncode:
            raise SystemExit(f"the paced writer to {out} failed:\n{run.stderr[-3000:]}")
        return float(run.stdout.strip().splitlines()[-1])
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "hookscope.cli",
            "extract",
            "--out",
            out,
            "--max-tokens",
            str(max_tokens),
            *options,
        ],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if run.returncode:
        raise SystemExit(f"extract to {out} failed:\n{run.stderr[-3000:]}")
    m = re.search(r"wrote ([\d,]+) rows in ([\d.]+) s", run.stdout)
    return int(m.group(1).replace(",", "")) / float(m.group(2))


def extraction(args, code: dict[str, Path], env: dict[str, str], tmp: Path) -> dict:
    """Each case: local / s3 after / s3 before, fresh processes, the order rotating per round."""
    out: dict = {}
    where = {
        "local": lambda i: str(tmp / f"x{i}"),
        "s3 after": lambda i: f"s3://bench/xa{i}",
        "s3 before": lambda i: f"s3://bench/xb{i}",
    }
    for case in args.cases.split(","):
        options, extra, tokens = CASES[case]
        tokens = args.max_tokens or tokens
        rates: dict[str, list[float]] = {k: [] for k in where}
        loads = []
        for i in range(args.extract_runs):
            order = list(where)[i % 3 :] + list(where)[: i % 3]
            for name in order:
                tree = code["before" if name.endswith("before") else "after"]
                rates[name].append(
                    extract_rate(
                        where[name](f"{case}{i}"),
                        tokens,
                        options,
                        {**env, **extra, "PYTHONPATH": str(tree), "PACE": str(args.pace)},
                    )
                )
            shutil.rmtree(tmp / f"x{case}{i}")
            loads.append(load())
            print(
                f"extract {case} {i}: "
                + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in rates.items())
                + f" tokens/s; load {loads[-1]}",
                flush=True,
            )
        med = {k: statistics.median(v) for k, v in rates.items()}
        paired = {
            k: [a / b for a, b in zip(rates[k], rates["local"], strict=True)]
            for k in ("s3 after", "s3 before")
        }
        out[case] = {
            "tokens_per_s": med,
            "s3_after_over_local": med["s3 after"] / med["local"],
            "s3_before_over_local": med["s3 before"] / med["local"],
            "paired_over_local": paired,
            "runs": rates,
            "loads": loads,
            "env": extra,
            "tokens": tokens,
            **({"pace_s": args.pace} if options == ["paced"] else {}),
        }
    return out


def moto_rate(mb: int = 13, runs: int = 3) -> dict[str, float]:
    """MB/s moto takes one object of `mb` MB at: one PUT, and two parts uploaded at once."""
    import s3fs

    sys.path.insert(0, str(REPO / "src"))  # this tree's uploader, not the one the venv installed
    from hookscope.store.upload import UploadSettings, upload_file

    fs, size = s3fs.S3FileSystem(), mb * 10**6
    out = {}
    with tempfile.NamedTemporaryFile() as f:
        f.write(os.urandom(size))
        f.flush()
        for name, part in (("one PUT", size), ("2 parts at once", (size + 1) // 2)):
            times = []
            for _ in range(runs):
                t0 = time.perf_counter()
                upload_file(fs, Path(f.name), "bench/rate", "moto", UploadSettings(part, threads=2))
                times.append(time.perf_counter() - t0)
            out[name] = mb / statistics.median(times)
    return out


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def reading(args, servers: dict, code: dict[str, Path], env: dict[str, str], tmp: Path) -> dict:
    """Reads of the synthetic store: local and each server, this tree and --before, rounds alternating."""
    import s3fs

    local = tmp / "store"
    code["before"] = checkout(args.before, tmp / "before")
    # written by the "before" tree: its format (1) is one both readers take (after reads 1 and 2)
    subprocess.run(
        [sys.executable, __file__, "--write-store", str(local), "--shards", str(args.shards)],
        env={**env, "PYTHONPATH": str(code["before"])},
        check=True,
    )
    for _, endpoint in servers.values():
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        s3fs.S3FileSystem.clear_instance_cache()
        fs = s3fs.S3FileSystem()
        fs.mkdir("bench")
        fs.put(str(local) + "/", "bench/store", recursive=True)
    places = [("local", str(local), "")] + [(n, "s3://bench/store", e) for n, (_, e) in servers.items()]
    reads = [[f"{w}/{m}", where, endpoint, m] for m in ("seq", "shuffled") for w, where, endpoint in places]
    runs: dict[str, list[dict[str, float]]] = {}
    for r in range(args.runs):
        for c in ("after", "before") if r % 2 == 0 else ("before", "after"):
            for result in read_round(code[c], reads, env):
                runs.setdefault(f"{c}/{result['name']}", []).append(result)
        last = ", ".join(f"{k} {v[-1]['rows_per_s']:,.0f}" for k, v in sorted(runs.items()))
        print(f"round {r}: {last} rows/s; load {load()}", flush=True)
    med = {k: statistics.median(x["rows_per_s"] for x in v) for k, v in sorted(runs.items())}
    ratios = {}
    for server in servers:
        for m in ("seq", "shuffled"):
            for c in ("after", "before"):
                ratios[f"{c}/{server}/{m} over {c}/local/{m}"] = (
                    med[f"{c}/{server}/{m}"] / med[f"{c}/local/{m}"]
                )
            ratios[f"after/{server}/{m} over before/{server}/{m}"] = (
                med[f"after/{server}/{m}"] / med[f"before/{server}/{m}"]
            )
    return {
        "rows_per_s": med,
        "ratios": ratios,
        "open_s": {k: statistics.median(x["open_s"] for x in v) for k, v in sorted(runs.items())},
        "mib_fetched_after": {
            k: v[-1]["mib_fetched"]
            for k, v in sorted(runs.items())
            if k.startswith("after/") and "/local/" not in k
        },
        "store": {
            "rows": args.shards * SHARD_ROWS,
            "shards": args.shards,
            "mib": sum(p.stat().st_size for p in local.rglob("*")) / 2**20,
        },
        "runs": {k: [x["rows_per_s"] for x in v] for k, v in sorted(runs.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=4, help="rounds of the read configurations")
    parser.add_argument("--shards", type=int, default=8, help="shards in the read store (~16.1 MiB each)")
    parser.add_argument("--servers", default="moto,s3rver", help="S3 servers to read from: moto, s3rver")
    parser.add_argument("--before", default=BEFORE, help="commit whose reader is 'before'")
    parser.add_argument("--extract-runs", type=int, default=0, help="rounds of extraction, local vs moto")
    parser.add_argument("--max-tokens", type=int, help="tokens per extraction run (default: the case's)")
    parser.add_argument("--cases", default=",".join(CASES), help="cases: " + ", ".join(CASES))
    parser.add_argument("--extract-before", default=EXTRACT_BEFORE, help="commit whose writer is 'before'")
    parser.add_argument("--write-store", metavar="DIR", help=argparse.SUPPRESS)  # child: write the store
    parser.add_argument("--paced", metavar="OUT", help=argparse.SUPPRESS)  # child: the paced writer
    parser.add_argument("--pace", type=float, default=PACE[3], help="paced cases: seconds a batch computes")
    args = parser.parse_args()
    if args.paced:
        write_paced(args.paced, args.pace)
        return
    if args.write_store:
        write_store(Path(args.write_store), args.shards)
        return
    tmp = Path(tempfile.mkdtemp(prefix="hookscope-bench-"))
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    report: dict = {"load_at_start": load()}
    env = {
        **os.environ,
        "AWS_DEFAULT_REGION": "us-east-1",
        "OMP_NUM_THREADS": "2",
        # moto takes any credentials; s3rver wants its own
        "AWS_ACCESS_KEY_ID": "S3RVER",
        "AWS_SECRET_ACCESS_KEY": "S3RVER",
    }
    os.environ.update(env)
    try:
        for name in args.servers.split(","):
            if name not in ("moto", "s3rver"):
                raise SystemExit(f"unknown server {name!r}: use moto, s3rver")
            started = start_moto() if name == "moto" else start_s3rver(tmp / "s3rver")
            if started is not None:
                servers[name] = started
        import s3fs

        code = {"after": REPO / "src"}
        if args.runs:
            report["reads"] = reading(args, servers, code, env, tmp)
        if args.extract_runs:
            if "moto" not in servers:
                raise SystemExit("--extract-runs needs the moto server (--servers moto)")
            env["AWS_ENDPOINT_URL"] = os.environ["AWS_ENDPOINT_URL"] = servers["moto"][1]
            s3fs.S3FileSystem.clear_instance_cache()
            if not s3fs.S3FileSystem().exists("bench"):
                s3fs.S3FileSystem().mkdir("bench")
            code["before"] = checkout(args.extract_before, tmp / "extract-before")
            report["extract"] = extraction(args, code, env, tmp)
            report["moto_mb_per_s"] = moto_rate()
    finally:
        for server, _ in servers.values():
            server.terminate()
            server.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    report["load_at_end"] = load()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
