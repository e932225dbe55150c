"""What the elastic-resume tests of the extraction pipeline share (test_extract.py, locally, and
test_store_s3.py, on an S3 server): a run killed under one number of processes and finished under
another, and the row-for-row comparison with an uninterrupted one-process run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from hookscope.store import open_store

HERE = Path(__file__).parent


def torchrun_command(nproc: int) -> list[str]:
    with socket.socket() as sock:  # a free port: a fixed one collides with other test runs on the machine
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
    ]


def _origin(store) -> torch.Tensor:
    """What orders a one-process run's rows: the packed sequence (text), else the image."""
    return store.tensor("seq_ids" if "seq_ids" in store.manifest.columns else "doc_ids")


def in_batch_order(store) -> dict[str, torch.Tensor]:
    """Every column, rows sorted stably by packed sequence (or image): a one-process run's order."""
    order = torch.sort(_origin(store), stable=True).indices
    return {name: store.tensor(name)[order] for name in store.manifest.columns}


def run_elastic(cli: list[str], first: int, then: int, kill_at: str) -> None:
    """`hookscope cli...` with `first` processes, each SIGKILLed at `kill_at` (kill_driver.py's
    sites); then the same command with `then` processes, to the end."""
    environ = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed = [str(HERE / "kill_driver.py"), "cli", "KILL", kill_at, *cli]
    cmd = [*torchrun_command(first), *killed] if first > 1 else [sys.executable, *killed]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=environ)
    assert run.returncode != 0, run.stderr[-3000:]  # it died mid-run
    resumed = ["-m", "hookscope.cli", *cli]
    cmd = [*torchrun_command(then), *resumed] if then > 1 else [sys.executable, *resumed]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=environ)
    assert run.returncode == 0, run.stderr[-3000:]


def assert_same_rows_as(got_path, reference_path, first: int, then: int) -> None:
    got, want = open_store(got_path, verify=True), open_store(reference_path)
    origin = _origin(want)
    assert torch.equal(origin, torch.sort(origin).values)  # one process writes them in order
    a, b = in_batch_order(got), in_batch_order(want)
    assert a.keys() == b.keys() and len(got) == len(want) > 0
    for name in b:
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name  # bit for bit
    m = got.manifest
    assert (m.generation, m.world_size) == (1, then)  # a second attempt, with the other world size
    early = [s for s in m.shards if s.generation == 0]
    assert early and {s.rank for s in early} <= set(range(first))  # the killed attempt had committed shards
    assert sorted(b for s in m.shards for b in s.batch_indices()) == list(range(1 + max(m.done_batches())))
