"""Tokenizing documents for packing: chunks of `TOKENIZE_BATCH` documents, each one tokenizer call,
in order; in the calling thread (`workers=0`: a fast tokenizer's batch encode runs in its own Rust
threads, without the GIL) or in `workers` processes, so that nothing of it waits on the GIL.

Each chunk comes back as (first document index, flat token ids, tokens per document) in numpy, so
that packing never walks tokens in Python. Worker processes get the chunks in order and at most
`2 * workers` chunks are out at once (memory stays flat); results are taken in submission order, so
the stream is the same for any number of workers. A worker that fails or dies ends the run with a
DataError; closing the stream (end, error, Ctrl-C) stops the workers, and a worker whose parent
dies exits on its own (it polls its parent).
"""

from __future__ import annotations

import collections
import itertools
import multiprocessing
import os
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
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
    out = tokenizer(chunk, add_special_tokens=False, verbose=False, return_attention_mask=False,
                    return_token_type_ids=False)["input_ids"]
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


_worker_tokenizer: Any = None


def _start_worker(tokenizer: Any, parent: int) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the processes are the parallelism

    def watch() -> None:  # a parent killed outright (SIGKILL) cannot stop its pool: leave with it
        while True:
            threading.Event().wait(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _encode_in_worker(chunk: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return encode(_worker_tokenizer, chunk)


def _in_processes(documents: Iterable[str], tokenizer: Any, workers: int) -> Iterator[Chunk]:
    # spawn, not fork: the parent has threads (the writer's, torch's) that a fork would copy mid-step
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_worker, initargs=(tokenizer, os.getpid()))
    pending: collections.deque[tuple[int, int, Future]] = collections.deque()
    first = 0
    try:
        source = chunks(documents)
        while True:
            while len(pending) < 2 * workers:
                chunk = next(source, None)
                if chunk is None:
                    break
                pending.append((first, len(chunk), pool.submit(_encode_in_worker, chunk)))
                first += len(chunk)
            if not pending:
                return
            start, count, future = pending.popleft()
            yield (start, *_result(future, start, count))
    finally:
        for *_, future in pending:
            future.cancel()
        _stop(pool)


def _result(future: Future, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    where = f"documents {start}-{start + count - 1}"
    try:
        return future.result()
    except BrokenProcessPool as e:
        raise DataError(f"a tokenizer worker process died while tokenizing {where} (out of memory?); "
                        "run again with fewer --workers, or --workers 0 to tokenize in-process") from e
    except Exception as e:  # the tokenizer's own error, raised in the worker
        raise DataError(f"tokenizing {where} failed in a worker process: {type(e).__name__}: {e}") from e


def _stop(pool: ProcessPoolExecutor) -> None:
    """Stop the pool now: workers busy on chunks no one will read are terminated, then reaped."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
