"""`--workers N`: tokenizing in worker processes keeps the batches, names a worker's failure, and
leaves no process behind on Ctrl-C, on a kill, or when the consumer stops early."""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers
from forkserver import ForkServer
from helpers import corpus_fixture, extract_cli_args
from tokenizers import Tokenizer, models, pre_tokenizers

import hookscope.sources.text as text_source
from hookscope.cli import main
from hookscope.errors import DataError, HookscopeError
from hookscope.extract import ExtractConfig
from hookscope.extract_config import validate_config
from hookscope.sources.packing import pack_batches
from hookscope.store import open_store

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process checks read /proc")


def words_tokenizer() -> transformers.PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["<eos>", "poison", "die", *"abcdefgh"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


class Trapped:
    """The tokenizer, failing in the worker on a document that says "poison" or "die"."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __call__(self, docs, **kwargs):
        if any("poison" in d for d in docs):
            raise ValueError("this tokenizer refuses poison")
        if any("die" in d for d in docs):
            os._exit(3)
        return self.tokenizer(docs, **kwargs)


def docs_with(bad: str, at: int) -> list[str]:
    return [bad if i == at else "a b c d e f g h " * 3 for i in range(400)]


def test_a_tokenizer_error_in_a_worker_is_a_data_error_naming_the_documents():
    with pytest.raises(
        DataError,
        match=r"documents 192-255 failed in a worker.*ValueError: this "
        r"tokenizer refuses poison",
    ):
        list(pack_batches(docs_with("poison", 200), Trapped(words_tokenizer()), 16, 4, workers=2))


def test_a_worker_that_dies_is_a_data_error():
    died = r"worker process died while tokenizing documents 64-127 \(exit code 3.*--workers 0"
    with pytest.raises(DataError, match=died):
        list(pack_batches(docs_with("die", 70), Trapped(words_tokenizer()), 16, 4, workers=2))


def children(pid: int) -> set[int]:
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text() if (task / "children").exists() else ""
        out |= {int(c) for c in text.split()}
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_stopping_early_leaves_no_worker():
    before = children(os.getpid())  # the suite's other children (servers)
    batches = pack_batches(iter(lambda: "a b c d", None), words_tokenizer(), 16, 4, workers=2)
    next(batches)
    assert len(children(os.getpid()) - before) >= 2
    batches.close()
    assert not [p for p in children(os.getpid()) - before if alive(p)]


def test_workers_stop_at_once_under_a_parents_python_sigterm_handler():
    """A handler the parent set (a trainer's, or the run's own) must not keep the workers alive: a
    forked worker inherits it, so a SIGTERM to stop it would wait out the join timeout (5 s a worker)."""
    before = children(os.getpid())
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # as SAELens's training runner leaves it
    try:
        batches = pack_batches(iter(lambda: "a b c d", None), words_tokenizer(), 16, 4, workers=2)
        next(batches)
        started = time.perf_counter()
        batches.close()
        stopped = time.perf_counter() - started
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not [p for p in children(os.getpid()) - before if alive(p)]
    assert stopped < 2.0, f"stopping two workers took {stopped:.1f} s"


def pack_endlessly(ready: str) -> None:
    """A fork-server child (tests/kit/forkserver.py): packs an endless corpus with two workers and,
    five batches in, writes its pid and its workers' to `ready`, then packs on until a signal ends
    it. SIGINT gets Python's own handler back: a child of a shell's background job inherits it
    ignored."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    docs = (" ".join("abcdefgh"[(i + j) % 8] for j in range(50)) for i in itertools.count())
    for n, _ in enumerate(pack_batches(docs, words_tokenizer(), 64, 8, workers=2)):
        if n == 5:
            pids = {"pid": os.getpid(), "workers": sorted(children(os.getpid()))}
            Path(ready + ".tmp").write_text(json.dumps(pids))
            os.replace(ready + ".tmp", ready)  # whole or absent for the test that polls it


@pytest.fixture(scope="module")
def server() -> ForkServer:
    server = ForkServer.shared()
    server.warm("test_packing_workers:words_tokenizer")  # the test module imported before forking
    return server


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL])
@pytest.mark.slow
def test_ctrl_c_or_a_kill_leaves_no_worker(how, server, tmp_path: Path):
    """The packing process (a fork-server child: a real process, without a Python start-up) is sent
    `how` from outside while it packs: its workers must not outlive it."""
    ready = tmp_path / "ready.json"
    packing = None
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(server.call, "test_packing_workers:pack_endlessly", ready=str(ready), timeout=120)
        try:
            deadline = time.monotonic() + 60
            while not ready.exists():
                assert not run.done() and time.monotonic() < deadline, run.result().log[-3000:]
                time.sleep(0.05)
            packing = json.loads(ready.read_text())
            assert len(packing["workers"]) >= 2
            os.kill(packing["pid"], how)
            reply = run.result(timeout=60)
        finally:
            if packing is not None and not run.done():
                os.kill(packing["pid"], signal.SIGKILL)
    workers = packing["workers"]
    deadline = time.monotonic() + 30
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in workers if alive(p)], "worker processes outlived their parent"
    if how == signal.SIGINT:  # the parent's KeyboardInterrupt, raised where it was
        assert reply.status == 1 and "KeyboardInterrupt" in reply.log, reply.log[-3000:]
    else:
        assert reply.status == -signal.SIGKILL, reply.log[-3000:]


corpus = corpus_fixture(40)


def test_the_cli_takes_workers_and_refuses_a_negative_count(tiny_dirs, corpus, tmp_path, capsys, monkeypatch):
    seen = []
    real = text_source.pack_batches

    def spy(*args, **kwargs):
        seen.append(kwargs["workers"])
        return real(*args, **kwargs)

    monkeypatch.setattr(text_source, "pack_batches", spy)
    assert main(extract_cli_args(tiny_dirs["gpt2"], corpus, tmp_path / "a", **{"--workers": "2"})) == 0
    assert seen == [2]
    assert len(open_store(tmp_path / "a", verify=True).tensor("token_ids")) > 0
    with pytest.raises(HookscopeError, match="--workers -1: must be a whole number >= 0"):
        validate_config(ExtractConfig(out=str(tmp_path / "b"), workers=-1))
    with pytest.raises(SystemExit):
        main(extract_cli_args(tiny_dirs["gpt2"], corpus, tmp_path / "c", **{"--workers": "-1"}))
    assert "--workers" in capsys.readouterr().err


@pytest.mark.slow
def test_chunks_larger_than_a_pipe_do_not_deadlock():
    """The parent sends the next chunk while the worker sends back a result of megabytes."""
    # ~8,000 tokens each, each its own object (pickle would send one shared string once):
    # 1 MB a chunk out, 4 MB back; four chunks of 64: the third is sent while the worker sends
    # back the second's result
    docs = ["a b c d e f g h " * 1000 + "abcdefgh"[i % 8] for i in range(256)]

    def hung(*_):
        raise TimeoutError("packing with a worker hung")

    before = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    try:
        got = list(pack_batches(docs, words_tokenizer(), 512, 8, workers=1))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
    want = list(pack_batches(docs, words_tokenizer(), 512, 8))
    assert len(got) == len(want) > 450  # 256 * 8,001 tokens in rows of 512, 8 a batch
    assert all(torch.equal(g["input_ids"], w["input_ids"]) for g, w in zip(got, want, strict=True))


def test_progress_is_exact_for_documents_as_far_back_as_the_workers_read_ahead():
    from hookscope.sources.fingerprint import ReadMeter

    docs = [f"{'x' * (i % 13 + 1)}" for i in range(2000)]
    meter = ReadMeter(docs, total_chars=sum(map(len, docs)), workers=4)
    for _ in meter:
        pass
    back = 2000 - (4 + 2 * 4) * 64  # the oldest document a packing with 4 workers can still be on
    assert meter.fraction(back) == sum(map(len, docs[: back + 1])) / meter.total_chars
