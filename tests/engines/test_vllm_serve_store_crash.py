"""`vllm serve` writing a hookscope store, killed mid-run: the store's crash promises under a server
(engines/vllm/capture_store.py), driven over HTTP by urllib on 127.0.0.1.

One server on a new store, shards of 8 rows: short and long requests sent at once, each asking for
its rows under its own `hookscope.capture_id`; once the first shard is committed (a short request
done) the server's whole process group is killed (SIGKILL) while the long ones still generate.
Then:
- the store opens and verifies; every request in it is whole (positions 0..n-1, the tokens its
  generation alone gives, values equal to hookscope's Hugging Face `hs.generate` of its prompt
  alone); a request killed mid-generation has no row at all.
- a server started again on the store starts (the lock the killed one held is gone with it, its
  half-written shard deleted) and appends: the shards committed before the kill are still listed,
  byte for byte, and its requests' batches come after theirs. When that server's process group gets
  SIGINT (a terminal's Ctrl-C) while a request generates, the workers stop at once: that request
  has no row, and the finished ones are committed. (SIGTERM to the API server alone, which drains
  the requests in flight: test_vllm_serve_store.py.)
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
import types

import pytest
import torch
from gate import need

need("vllm")

from vllm_models import assert_close, hf_model, save  # noqa: E402
from vllm_server import completion, send_at_once, start, stop, wait_closed, wait_running  # noqa: E402
from vllm_shared import key_of  # noqa: E402

import hookscope as hs  # noqa: E402
from hookscope.engines.vllm import serve  # noqa: E402

POINTS = ["blocks.0.attn.z", "blocks.1.resid_post"]
SHORT, LONG = 4, 64  # tokens generated (max_tokens) by the short and the long requests


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# capture id -> (prompt, max_tokens); the killed server's, then the restarted one's
KILLED = {
    **{f"short{i}": (prompt(n, i), SHORT) for i, n in enumerate((6, 11, 19))},
    **{f"long{i}": (prompt(n, 10 + i), LONG) for i, n in enumerate((8, 23, 37))},
}
AGAIN = {f"again{i}": (prompt(n, 20 + i), SHORT) for i, n in enumerate((9, 30))}
CUT = {"cut": (prompt(14, 30), 190)}  # running when the server's process group gets SIGINT
ALL = {**KILLED, **AGAIN, **CUT}


def send_all(url: str, directory, requests: dict, answers: dict) -> list[threading.Thread]:
    """The requests of `requests` sent at once, each asking for its rows under its name."""
    bodies = {
        name: completion(directory, tokens, new, {"hookscope.capture": 1, "hookscope.capture_id": name})
        for name, (tokens, new) in requests.items()
    }
    return send_at_once(url, bodies, answers)


def shards(out) -> dict[str, str]:
    """The committed shards of the store at `out`: file -> its SHA-256, from the bytes on disk."""
    store = hs.open_store(out)
    return {s.file: hashlib.sha256((out / s.file).read_bytes()).hexdigest() for s in store.manifest.shards}


def wait_for_a_commit(out, proc, timeout: float = 300.0) -> None:
    journal = out / "manifest.journal"
    deadline = time.monotonic() + timeout
    while not (journal.exists() and journal.stat().st_size > 0):
        if time.monotonic() > deadline or proc.poll() is not None:
            pytest.fail("the server committed no shard")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_store_crash")
    directory = save("llama", tmp / "llama", seed=5)
    out, log = tmp / "acts", tmp / "server.log"
    answers: dict = {}
    # shards of 8 rows: each request's rows (one batch) commit a shard of their own
    proc, url, _ = start(directory, serve.serve_flags(store=out, points=POINTS, shard_rows=8), log)
    try:
        threads = send_all(url, directory, KILLED, answers)
        wait_for_a_commit(out, proc)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        stop(proc)
    for t in threads:
        t.join()
    after_kill = types.SimpleNamespace(shards=shards(out), store=hs.open_store(out))

    proc, url, _ = start(directory, serve.serve_flags(store=out, points=POINTS, shard_rows=1000), log)
    try:
        for t in send_all(url, directory, AGAIN, answers):
            t.join()
        (cut,) = send_all(url, directory, CUT, answers)
        wait_running(url, proc)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: every process of the server
        wait_closed(out)
    finally:
        # (the API server then waits on the cut request's open connection: ended here)
        stop(proc)
    cut.join()
    return types.SimpleNamespace(
        directory=directory, out=out, answers=answers, after_kill=after_kill, final=hs.open_store(out)
    )


@pytest.fixture(scope="module")
def references(crashed):
    """Hugging Face's `hs.generate` of each prompt alone, as many tokens as its request asked."""
    hf = hf_model(crashed.directory)
    return {
        name: hs.generate(hf, torch.tensor([tokens]), POINTS, max_new_tokens=new, do_sample=False)
        for name, (tokens, new) in ALL.items()
    }


def requests_in(store) -> dict[str, torch.Tensor]:
    """Each request's rows in `store`: its name -> a mask of its rows; a row of no known request
    fails."""
    docs = store.tensor("doc_ids")
    found = {name: docs == key_of(name) for name in ALL}
    known = torch.stack(list(found.values())).any(dim=0)
    assert known.all(), f"{int((~known).sum())} rows of no request sent"
    return {name: mask for name, mask in found.items() if mask.any()}


def assert_whole(store, name: str, mask: torch.Tensor, want: hs.Generation) -> None:
    """`name`'s rows: positions 0..n-1, its generation's tokens and values, n every token but the
    last sampled."""
    n, length = int(mask.sum()), len(ALL[name][0])
    assert n == want.sequences.shape[1] - 1, f"{name}: {n} rows of {want.sequences.shape[1] - 1}"
    assert store.tensor("positions")[mask].tolist() == list(range(n)), f"{name}: positions"
    assert store.tensor("token_ids")[mask].tolist() == want.sequences[0, :n].tolist(), f"{name}: tokens"
    assert store.tensor("generated")[mask].tolist() == [0] * length + [1] * (n - length), name
    for point in POINTS:
        assert_close(store.tensor(point)[mask], want[point][0, :n], f"{name} {point}")


@pytest.mark.slow  # two server starts: 1-3 minutes
def test_a_killed_server_leaves_whole_requests_that_verify(crashed, references):
    store = crashed.after_kill.store
    store.verify()
    found = requests_in(store)
    assert found, "nothing was committed before the kill"
    for name, mask in found.items():
        assert_whole(store, name, mask, references[name])
    killed = [name for name in KILLED if name not in found and crashed.answers[name][0] != 200]
    assert killed, "every request finished before the kill: nothing was killed mid-run"


@pytest.mark.slow
def test_a_server_started_again_appends_after_what_was_committed(crashed, references):
    store = crashed.final
    store.verify()
    before = crashed.after_kill.shards
    assert {file: sha for file, sha in shards(crashed.out).items() if file in before} == before, (
        "a shard committed before the kill changed or went"
    )
    found = requests_in(store)
    seq = store.tensor("seq_ids")
    last_before = max(int(seq[found[name]].max()) for name in requests_in(crashed.after_kill.store))
    for name in AGAIN:
        status, body = crashed.answers[name]
        assert status == 200, (name, body)
        assert int(seq[found[name]].min()) > last_before, f"{name}: not after the committed batches"
        assert_whole(store, name, found[name], references[name])
    for name in found.keys() & KILLED.keys():  # what the killed server committed, still there whole
        assert_whole(store, name, found[name], references[name])


@pytest.mark.slow
def test_a_request_running_at_ctrl_c_has_no_rows_and_the_finished_ones_are_committed(crashed, references):
    found = requests_in(crashed.final)
    status, _ = crashed.answers["cut"]
    assert status != 200, "the request finished before the signal: nothing was cut"
    assert "cut" not in found, "a request cut short by the signal has rows in the store"
    for name in AGAIN:  # finished before the signal, in the shard the writer committed as it closed
        assert_whole(crashed.final, name, found[name], references[name])
