"""What the elastic-resume tests of the extraction pipeline share (test_extract.py, locally, and
test_store_s3.py, on an S3 server): a run killed under one number of processes and finished under
another, and the row-for-row comparison with an uninterrupted one-process run; and the torchrun
command the torchrun tests launch."""

from __future__ import annotations

import socket
import sys

import torch
from forkserver import ForkServer

from hookscope.store import open_store

RUN_CLI = "kill_driver:run_cli"


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


def run_elastic(
    server: ForkServer, cli: list[str], first: int, then: int, kill_at: str, environ: dict | None = None
) -> None:
    """`hookscope cli...` with `first` processes, each SIGKILLed at `kill_at` (kill_driver.py's
    sites); then the same command with `then` processes, to the end. The processes are children of
    the fork server `server` (tests/kit/forkserver.py) with torchrun's environment for their rank
    (torchrun itself launches the ranks of tests/engines/test_tensor_parallel.py); `environ` is
    added to theirs."""
    killed = server.call_ranks(first, RUN_CLI, args=cli, signal_name="KILL", kill_at=kill_at, environ=environ)
    assert any(r.status != 0 for r in killed), [r.log[-3000:] for r in killed]  # it died mid-run
    run_ranks(server, then, cli, environ)


def run_ranks(server: ForkServer, world_size: int, cli: list[str], environ: dict | None = None) -> None:
    """`hookscope cli...` run to the end by `world_size` ranks, children of the fork server with
    torchrun's environment for their rank (see `run_elastic`)."""
    ranks = server.call_ranks(
        world_size, RUN_CLI, args=cli, signal_name="KILL", kill_at="never", environ=environ
    )
    assert all(r.status == 0 and r.result["code"] == 0 for r in ranks), [r.log[-3000:] for r in ranks]


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
