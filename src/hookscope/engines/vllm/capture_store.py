"""Under `vllm serve`: the captured requests' rows written into a hookscope store.

The operator names a store directory and its points in hookscope's `--additional-config` (serve.py
checks them), and a request opts in with `"vllm_xargs": {"hookscope.capture": 1}`. The first worker's
capture (worker.py's `StoreSession`, on the same table and hooks as every capture) hands each request
here once vLLM has let go of it (its prompt's and generated tokens' rows: every token the model ran
for it, which leaves out the last token sampled), or, with `"generated": false`, once its prompt's
last token has run (its prompt's rows only). `RequestWriter` writes it into the store with
`ShardWriter` (the format, manifest and crash promises of `hookscope extract`): one batch per request,
a shard committed each time `shard_rows` rows fill it, the last when the worker's process exits.
The `generated` column tells a generated token's row (1) from a prompt token's (0).
Each row's `doc_ids` is `doc_id(key)`, where `key` is the request's own `hookscope.capture_id` if it
gave one, else vLLM's id of it (`client_id`): a completion's `id` and `-{i}` for its i-th prompt
(`cmpl-...-0`), a chat completion's `id`.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing.util

import torch
from torch import Tensor

from ...errors import StoreError
from ...store import ShardWriter

log = logging.getLogger("hookscope")

# seconds vLLM gives its processes to stop (--shutdown-timeout): the first worker's last shard is
# written and committed in them
SHUTDOWN_TIMEOUT = 30
# the order of the work done as a worker's process exits (multiprocessing's finalizers, the higher
# first): the requests that ended handed to the writer, then the writer closed
WRITER_EXIT = 10


def doc_id(key: str) -> int:
    """The store's `doc_ids` value of the rows of the request filed under `key`: the first 8 bytes
    of the SHA-256 of its UTF-8, little-endian, halved (a non-negative int64)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def client_id(req_id: str) -> str:
    """vLLM's request id as its API server named it: the engine adds "-" and 8 random characters
    (`InputProcessor.assign_request_id`) unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is set."""
    from vllm import envs

    return req_id if envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION else req_id.rsplit("-", 1)[0]


def columns(tokens: list[int], prompt_length: int, key: str, batch: int) -> dict[str, Tensor]:
    """A captured request's meta columns: its tokens (the prompt's `prompt_length`, then generated
    ones), `doc_id(key)`, positions, its batch, and which rows are generated tokens'."""
    n = len(tokens)
    positions = torch.arange(n)
    return {
        "token_ids": torch.tensor(tokens, dtype=torch.int64),
        "doc_ids": torch.full((n,), doc_id(key), dtype=torch.int64),
        "positions": positions,
        "seq_ids": torch.full((n,), batch, dtype=torch.int64),
        "generated": (positions >= prompt_length).long(),
    }


class RequestWriter:
    """The server's store, opened (or resumed: batches go on after the last one committed) in the
    first worker, and closed, its last shard committed, when the worker's process exits."""

    def __init__(self, out: str, settings: dict, shard_rows: int):
        self.writer: ShardWriter | None = ShardWriter(out, settings, shard_rows=shard_rows)
        self.next_batch = 1 + max(self.writer.done_batches, default=-1)
        # run as a multiprocessing child (vLLM's engine core and workers) ends, and at interpreter exit
        multiprocessing.util.Finalize(self, self.close, exitpriority=WRITER_EXIT)

    def write(self, key: str, tokens: list[int], prompt_length: int, rows: dict[str, Tensor]) -> None:
        """One request's rows ({point: [tokens, ...]}, in position order, the prompt's first) as the
        next batch. A store that failed is logged and no longer written: the server keeps serving."""
        if self.writer is None:
            return
        batch = self.next_batch
        self.next_batch += 1
        try:
            self.writer.write(batch, rows, columns(tokens, prompt_length, key, batch))
        except StoreError as e:
            log.error("hookscope: writing the store failed, no more requests are captured: %s", e)
            self.writer = None

    def close(self) -> None:
        """The rows written so far committed (the last shard too)."""
        if self.writer is not None:
            try:
                self.writer.close()
            except StoreError as e:
                log.error("hookscope: closing the store failed: %s", e)
            self.writer = None
