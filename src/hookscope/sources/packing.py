"""Packing: documents -> fixed-length token sequences that remember where every token came from.

See `pack_policy`: the documents' tokens, with a separator token between documents, form one
stream; each sequence is a start token (BOS, or [CLS] for BERT-like tokenizers) followed by the
next `context - 1` tokens of the stream. Every token carries its document index and its index in
that document's tokenization (-1 for start, separator and padding tokens).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import DataError
from .tokenize import Chunk, tokenized

SEQUENCE_KEYS = ("input_ids", "attention_mask", "doc_ids", "doc_positions", "special_mask")


@dataclass(frozen=True)
class PackPolicy:
    """Which special tokens packing inserts; `as_dict()` belongs in a store's settings."""

    start_id: int | None  # opens every sequence: BOS, or [CLS] for BERT-like tokenizers
    separator_id: int | None  # between documents: EOS, else [SEP], else BOS
    pad_id: int  # fills the last, partial sequence when drop_remainder=False
    start_token: str | None
    separator_token: str | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "start": self.start_token,
            "separator": self.separator_token,
            "rule": "start token opens every sequence; separator between documents",
        }


def pack_policy(tokenizer: Any, bos: str | bool = "auto") -> PackPolicy:
    """`bos="auto"` uses the tokenizer's BOS (or CLS) token if it has one, `True` requires one,
    `False` starts sequences without one (documents are still separated)."""
    if bos not in ("auto", True, False):
        raise DataError(f"bos={bos!r}: use 'auto', True or False")
    start = _first_id(tokenizer, "bos_token_id", "cls_token_id")
    if bos is True and start is None:
        raise DataError(
            f"{type(tokenizer).__name__} has neither a BOS nor a CLS token; use bos='auto' or False"
        )
    start = start if bos else None
    separator = _first_id(tokenizer, "eos_token_id", "sep_token_id", "bos_token_id")
    pad = _first_id(tokenizer, "pad_token_id", "eos_token_id")

    def name(i: int | None) -> str | None:
        return None if i is None else tokenizer.convert_ids_to_tokens(i)

    return PackPolicy(start, separator, 0 if pad is None else pad, name(start), name(separator))


def _first_id(tokenizer: Any, *attributes: str) -> int | None:
    for attribute in attributes:
        value = getattr(tokenizer, attribute, None)
        if isinstance(value, int):
            return value
    return None


@dataclass(frozen=True)
class PackedSequence:
    """One sequence of `context` tokens. doc_ids / doc_positions are -1 on special and padding tokens."""

    seq_id: int
    input_ids: torch.Tensor  # [T] int64
    attention_mask: torch.Tensor  # [T] int64, 0 on padding
    doc_ids: torch.Tensor  # [T] int64: index of the token's document in the source's order
    doc_positions: torch.Tensor  # [T] int64: index of the token in its document's own tokenization
    special_mask: torch.Tensor  # [T] bool: start and separator tokens


def pack(
    documents: Iterable[str],
    tokenizer: Any,
    context: int = 128,
    *,
    bos: str | bool = "auto",
    drop_remainder: bool = True,
    max_tokens: int | None = None,
    workers: int = 0,
) -> Iterator[PackedSequence]:
    """Tokenize `documents` (without the tokenizer's own special tokens) and pack them into
    sequences of `context` tokens (see the module docstring). `max_tokens` caps the tokens emitted;
    the last partial sequence is dropped unless `drop_remainder=False`, which pads it. `workers`
    processes tokenize (0: this thread; see tokenize.py)."""
    return _split(_blocks(documents, tokenizer, context, bos, drop_remainder, max_tokens, workers))


def _split(blocks: Iterator[tuple[int, tuple[np.ndarray, ...]]]) -> Iterator[PackedSequence]:
    for first, arrays in blocks:
        for i in range(len(arrays[0])):
            yield PackedSequence(first + i, *(torch.from_numpy(a[i].copy()) for a in arrays))


def pack_batches(
    documents: Iterable[str],
    tokenizer: Any,
    context: int = 128,
    batch_size: int = 8,
    *,
    bos: str | bool = "auto",
    drop_remainder: bool = True,
    max_tokens: int | None = None,
    workers: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """`batches(pack(...), batch_size)`, the same batches, built a block of sequences at a time."""
    if batch_size < 1:
        raise DataError(f"batch_size={batch_size} must be >= 1")
    blocks = _blocks(documents, tokenizer, context, bos, drop_remainder, max_tokens, workers)
    return _batched(blocks, batch_size)


def _blocks(
    documents: Iterable[str],
    tokenizer: Any,
    context: int,
    bos: str | bool,
    drop_remainder: bool,
    max_tokens: int | None,
    workers: int,
) -> Iterator[tuple[int, tuple[np.ndarray, ...]]]:
    policy = pack_policy(tokenizer, bos)
    body = context - (policy.start_id is not None)
    if body < 1:
        raise DataError(f"context {context} leaves no room for text after the start token")
    if max_tokens is not None and max_tokens < 1:
        raise DataError(f"max_tokens={max_tokens} must be >= 1")
    stream = _stream(
        tokenized(documents, tokenizer, workers), policy, context, body, drop_remainder, max_tokens
    )
    return _rows(stream, policy, context, body, drop_remainder, max_tokens)


def _stream(
    chunks: Iterator[Chunk],
    policy: PackPolicy,
    context: int,
    body: int,
    drop_remainder: bool,
    max_tokens: int | None,
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
    """The body-token stream, a chunk of documents at a time: (ids, doc ids, positions, document
    tokens so far), a separator before every non-empty document but the first. It ends after the
    document at which the budget is spent (`_rows` would take no more), reading no further chunk."""
    length = seen = 0
    for first, flat, lengths in chunks:
        nonempty = np.flatnonzero(lengths)
        if not len(nonempty):
            continue
        sizes = lengths[nonempty]
        starts = np.cumsum(sizes) - sizes  # of each non-empty document in `flat`
        separated = np.full(len(sizes), policy.separator_id is not None)
        separated[0] &= seen > 0
        stop = _spent_after(length + np.cumsum(sizes + separated), context, body, drop_remainder, max_tokens)
        if stop is not None:
            nonempty, sizes, starts, separated = (
                nonempty[: stop + 1],
                sizes[: stop + 1],
                starts[: stop + 1],
                separated[: stop + 1],
            )
            flat = flat[: starts[-1] + sizes[-1]]
        docs = np.repeat(first + nonempty, sizes)
        positions = np.arange(len(flat)) - np.repeat(starts, sizes)
        at = starts[separated]
        ids = np.insert(flat, at, policy.separator_id or 0)
        seen += int(sizes.sum())
        length += len(ids)
        yield ids, np.insert(docs, at, -1), np.insert(positions, at, -1), seen
        if stop is not None:
            return


def _spent_after(
    ends: np.ndarray, context: int, body: int, drop_remainder: bool, max_tokens: int | None
) -> int | None:
    """Given the stream's length after each document, the first document after which the budget is
    spent: every full sequence it allows is out, and the remainder is dropped or already as long as
    the budget lets it be."""
    if max_tokens is None:
        return None
    full = max_tokens // context
    made = np.minimum(ends // body, full)
    spent = made == full
    if not drop_remainder:
        spent &= ends - made * body >= max_tokens - full * context - (context - body)
    hits = np.flatnonzero(spent)
    return int(hits[0]) if len(hits) else None


def _rows(
    stream: Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, int]],
    policy: PackPolicy,
    context: int,
    body: int,
    drop_remainder: bool,
    max_tokens: int | None,
) -> Iterator[tuple[int, tuple[np.ndarray, ...]]]:
    """Blocks of whole sequences, (first seq_id, their SEQUENCE_KEYS arrays [n, context]), then the
    padded remainder (drop_remainder=False); a DataError if there is not one sequence."""
    lead = context - body
    full = max_tokens // context if max_tokens is not None else sys.maxsize
    rest: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * 3  # stream tokens not yet in a sequence
    seq_id = seen = 0
    for *parts, seen in stream:  # noqa: B007 - the last count of tokens seen names a shortfall
        joined = [np.concatenate((r, p)) for r, p in zip(rest, parts, strict=True)]
        n = min(len(joined[0]) // body, full - seq_id)
        if n:
            yield seq_id, _sequences(policy, context, *(j[: n * body].reshape(n, body) for j in joined))
            seq_id += n
        rest = [j[n * body :] for j in joined]
    budget = sys.maxsize if max_tokens is None else max_tokens - seq_id * context
    kept = min(len(rest[0]), budget - lead)
    if not drop_remainder and kept > 0:
        yield seq_id, _sequences(policy, context, *(r[None, :kept] for r in rest))
        seq_id += 1
    if not seq_id:
        raise DataError(
            f"the data gave {seen} tokens, not enough for one sequence of {context}"
            + (f" within max_tokens={max_tokens}" if max_tokens is not None else "")
            + "; add data, lower --context, or keep the remainder (drop_remainder=False)"
        )


def _sequences(
    policy: PackPolicy, context: int, ids: np.ndarray, docs: np.ndarray, positions: np.ndarray
) -> tuple[np.ndarray, ...]:
    """Sequences [n, context] from their body tokens [n, <= body]: the start token first, padding last."""
    n, width = ids.shape
    lead = 0 if policy.start_id is None else 1
    real = lead + width

    def filled(body: np.ndarray, start: Any, pad: Any, dtype: Any) -> np.ndarray:
        out = np.empty((n, context), dtype=dtype)
        if lead:
            out[:, 0] = start
        out[:, lead:real], out[:, real:] = body, pad
        return out

    return (
        filled(ids, policy.start_id, policy.pad_id, np.int64),
        filled(np.ones_like(ids), 1, 0, np.int64),
        filled(docs, -1, -1, np.int64),
        filled(positions, -1, -1, np.int64),
        filled(docs == -1, True, False, bool),
    )


def _batched(
    blocks: Iterator[tuple[int, tuple[np.ndarray, ...]]], batch_size: int
) -> Iterator[dict[str, torch.Tensor]]:
    held: list[tuple[int, tuple[np.ndarray, ...]]] = []  # sequences not yet in a batch
    count = 0
    for block in blocks:
        held.append(block)
        count += len(block[1][0])
        while count >= batch_size:
            first, joined = _join(held)
            yield _batch(first, [a[:batch_size] for a in joined])
            held = [(first + batch_size, tuple(a[batch_size:] for a in joined))]
            count -= batch_size
    if count:
        yield _batch(*_join(held))


def _join(held: list[tuple[int, tuple[np.ndarray, ...]]]) -> tuple[int, tuple[np.ndarray, ...]]:
    if len(held) == 1:
        return held[0]
    return held[0][0], tuple(np.concatenate(a) for a in zip(*(arrays for _, arrays in held), strict=True))


def _batch(first: int, arrays: Iterable[np.ndarray]) -> dict[str, torch.Tensor]:
    out = {
        k: torch.from_numpy(np.ascontiguousarray(a).copy())
        for k, a in zip(SEQUENCE_KEYS, arrays, strict=True)
    }
    out["seq_ids"] = torch.arange(first, first + len(out["input_ids"]))
    return out


def batches(
    sequences: Iterable[PackedSequence], batch_size: int, *, drop_last: bool = False
) -> Iterator[dict[str, torch.Tensor]]:
    """Stack sequences into batches: input_ids, attention_mask, doc_ids, doc_positions,
    special_mask [B, T] and seq_ids [B]."""
    if batch_size < 1:
        raise DataError(f"batch_size={batch_size} must be >= 1")
    group: list[PackedSequence] = []
    for seq in sequences:
        group.append(seq)
        if len(group) == batch_size:
            yield _stack(group)
            group = []
    if group and not drop_last:
        yield _stack(group)


def _stack(group: list[PackedSequence]) -> dict[str, torch.Tensor]:
    out = {k: torch.stack([getattr(s, k) for s in group]) for k in SEQUENCE_KEYS}
    out["seq_ids"] = torch.tensor([s.seq_id for s in group])
    return out
