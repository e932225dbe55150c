"""Tokenizing documents for packing: chunks of `TOKENIZE_BATCH` documents, each one tokenizer call,
in order; in the calling thread (`workers=0`: a fast tokenizer's batch encode runs in its own Rust
threads, without the GIL) or in `workers` processes, so that nothing of it waits on the GIL.

Each chunk comes back as (first document index, flat token ids, tokens per document) in numpy, so
that packing never walks tokens in Python. With workers, chunk i goes to worker i % N and its result
is read back from that worker in turn, so the stream is the same for any N; each worker holds at
most two chunks (memory stays flat). A worker's tokenizer error or death is a DataError naming the
documents; closing the stream (its end, an error, Ctrl-C) terminates and reaps the workers, and a
worker whose parent is killed outright exits on its own (it watches its parent).
"""

from __future__ import annotations

import collections
import itertools
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from ..errors import DataError

TOKENIZE_BATCH = 64  # documents per tokenizer call: fast tokenizers work in parallel over a list

Chunk = tuple[int, np.ndarray, np.ndarray]  # first doc index, flat ids [sum lengths], lengths [docs]


def chunks(documents: Iterable[str]) -> Iterator[list[str]]:
    """`documents` in lists of `TOKENIZE_BATCH`; a non-string document is a DataError."""
    chunk: list[str] = []
    for doc in documents:
        if not isinstance(doc, str):
            raise DataError(f"documents must be strings, got {type(doc).__name__}")
        chunk.append(doc)
        if len(chunk) == TOKENIZE_BATCH:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def encode(tokenizer: Any, chunk: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """One tokenizer call over `chunk` (without the tokenizer's own special tokens), flattened."""
    out = tokenizer(
        chunk,
        add_special_tokens=False,
        verbose=False,
        return_attention_mask=False,
        return_token_type_ids=False,
    )["input_ids"]
    lengths = np.fromiter(map(len, out), dtype=np.int64, count=len(out))
    flat = np.fromiter(itertools.chain.from_iterable(out), dtype=np.int64, count=int(lengths.sum()))
    return flat, lengths


def tokenized(documents: Iterable[str], tokenizer: Any, workers: int = 0) -> Iterator[Chunk]:
    """The chunks of `documents`, tokenized, in order (see the module docstring)."""
    if workers < 0:
        raise DataError(f"workers={workers}: use 0 (tokenize in the data thread) or more processes")
    if workers == 0:
        first = 0
        for chunk in chunks(documents):
            yield (first, *encode(tokenizer, chunk))
            first += len(chunk)
        return
    yield from _in_processes(documents, tokenizer, workers)


def _in_processes(documents: Iterable[str], tokenizer: Any, workers: int) -> Iterator[Chunk]:
    # fork where it is safe (Linux): a spawned worker re-runs an unguarded __main__ script; the
    # forked worker only tokenizes, touching none of the locks the parent's other threads hold
    context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    pool: list[tuple[Any, Any]] = []  # (process, connection): chunk i goes to worker i % workers
    pending: collections.deque[tuple[int, int]] = collections.deque()  # (first doc, docs) sent
    first = 0
    try:
        for _ in range(workers):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_work, args=(theirs, tokenizer, os.getpid()), name="hookscope-tokenize", daemon=True
            )
            process.start()
            theirs.close()  # so that the worker's death reads as the end of its pipe
            pool.append((process, ours))
        source = chunks(documents)
        sent = 0
        while True:
            while len(pending) < 2 * workers:  # each worker holds up to two chunks: flat memory
                chunk = next(source, None)
                if chunk is None:
                    break
                _send(pool[sent % workers], chunk, first)
                pending.append((first, len(chunk)))
                first, sent = first + len(chunk), sent + 1
            if not pending:
                return
            start, count = pending.popleft()
            yield (start, *_receive(pool[(sent - len(pending) - 1) % workers], start, count))
    finally:
        _stop(pool)


def _work(connection: Any, tokenizer: Any, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops us
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def watch() -> None:  # a parent killed outright (SIGKILL) cannot stop us: leave with it
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    def receive() -> None:  # always reading, so a parent sending a chunk never waits on our result
        while True:
            try:
                inbox.put(connection.recv())
            except (EOFError, OSError):
                inbox.put(None)
                return

    threading.Thread(target=watch, daemon=True).start()
    threading.Thread(target=receive, daemon=True).start()
    while (chunk := inbox.get()) is not None:
        try:
            connection.send((True, encode(tokenizer, chunk)))
        except Exception as e:  # noqa: BLE001 - the tokenizer's own error, named in the parent
            connection.send((False, f"{type(e).__name__}: {e}"))


def _send(worker: tuple[Any, Any], chunk: list[str], first: int) -> None:
    try:
        worker[1].send(chunk)
    except (BrokenPipeError, ConnectionResetError):
        raise _died(worker[0], first, len(chunk)) from None


def _receive(worker: tuple[Any, Any], start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    process, connection = worker
    try:
        ok, result = connection.recv()
    except (EOFError, ConnectionResetError):
        raise _died(process, start, count) from None
    if not ok:
        raise DataError(
            f"tokenizing documents {start}-{start + count - 1} failed in a worker process: {result}"
        )
    return result


def _died(process: Any, start: int, count: int) -> DataError:
    process.join(timeout=5)
    code = process.exitcode
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    return DataError(
        "a tokenizer worker process died while tokenizing documents "
        f"{start}-{start + count - 1} "
        f"({how}; out of memory?); run again with fewer --workers, or --workers 0 to "
        "tokenize in the data thread"
    )


def _stop(pool: list[tuple[Any, Any]]) -> None:
    """Stop the workers now (they may be busy on chunks no one will read), then reap them. SIGKILL,
    not SIGTERM: a forked worker inherits the parent's Python handlers (a trainer's, the run's own),
    which would run only between its bytecodes, and it holds nothing to clean up."""
    for process, connection in pool:
        connection.close()
        if process.is_alive():
            process.kill()
    for process, _ in pool:
        process.join(timeout=5)
