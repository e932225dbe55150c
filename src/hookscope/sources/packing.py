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

import torch

from ..errors import DataError

TOKENIZE_BATCH = 64  # documents per tokenizer call: fast tokenizers work in parallel over a list


@dataclass(frozen=True)
class PackPolicy:
    """Which special tokens packing inserts; `as_dict()` belongs in a store's settings."""

    start_id: int | None  # opens every sequence: BOS, or [CLS] for BERT-like tokenizers
    separator_id: int | None  # between documents: EOS, else [SEP], else BOS
    pad_id: int  # fills the last, partial sequence when drop_remainder=False
    start_token: str | None
    separator_token: str | None

    def as_dict(self) -> dict[str, Any]:
        return {"start": self.start_token, "separator": self.separator_token,
                "rule": "start token opens every sequence; separator between documents"}


def pack_policy(tokenizer: Any, bos: str | bool = "auto") -> PackPolicy:
    """`bos="auto"` uses the tokenizer's BOS (or CLS) token if it has one, `True` requires one,
    `False` starts sequences without one (documents are still separated)."""
    if bos not in ("auto", True, False):
        raise DataError(f"bos={bos!r}: use 'auto', True or False")
    start = _first_id(tokenizer, "bos_token_id", "cls_token_id")
    if bos is True and start is None:
        raise DataError(f"{type(tokenizer).__name__} has neither a BOS nor a CLS token; "
                        "use bos='auto' or False")
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


def pack(documents: Iterable[str], tokenizer: Any, context: int = 128, *, bos: str | bool = "auto",
         drop_remainder: bool = True, max_tokens: int | None = None) -> Iterator[PackedSequence]:
    """Tokenize `documents` (without the tokenizer's own special tokens) and pack them into
    sequences of `context` tokens (see the module docstring). `max_tokens` caps the tokens emitted;
    the last partial sequence is dropped unless `drop_remainder=False`, which pads it."""
    policy = pack_policy(tokenizer, bos)
    body = context - (policy.start_id is not None)
    if body < 1:
        raise DataError(f"context {context} leaves no room for text after the start token")
    if max_tokens is not None and max_tokens < 1:
        raise DataError(f"max_tokens={max_tokens} must be >= 1")
    return _pack(documents, tokenizer, policy, context, body, drop_remainder, max_tokens)


def _pack(documents: Iterable[str], tokenizer: Any, policy: PackPolicy, context: int, body: int,
          drop_remainder: bool, max_tokens: int | None) -> Iterator[PackedSequence]:
    budget = max_tokens if max_tokens is not None else sys.maxsize
    lead = context - body
    ids: list[int] = []  # the stream of body tokens not yet emitted, with their origins
    docs: list[int] = []
    positions: list[int] = []
    seq_id = seen = 0
    for doc_id, tokens in _tokenized(documents, tokenizer):
        if not tokens:
            continue
        if seen and policy.separator_id is not None:
            ids.append(policy.separator_id)
            docs.append(-1)
            positions.append(-1)
        seen += len(tokens)
        ids += tokens
        docs += [doc_id] * len(tokens)
        positions += range(len(tokens))
        at = 0
        while len(ids) - at >= body and budget >= context:
            yield _sequence(seq_id, policy, context, ids[at : at + body], docs[at : at + body],
                            positions[at : at + body])
            seq_id, at, budget = seq_id + 1, at + body, budget - context
        del ids[:at], docs[:at], positions[:at]
        if budget < context and (drop_remainder or len(ids) >= budget - lead):
            break  # the budget is spent: read no further documents
    rest = min(len(ids), budget - lead)
    if not drop_remainder and rest > 0:
        yield _sequence(seq_id, policy, context, ids[:rest], docs[:rest], positions[:rest])
        seq_id += 1
    if not seq_id:
        raise DataError(f"the data gave {seen} tokens, not enough for one sequence of {context}"
                        + (f" within max_tokens={max_tokens}" if max_tokens is not None else "")
                        + "; add data, lower --context, or keep the remainder (drop_remainder=False)")


def _tokenized(documents: Iterable[str], tokenizer: Any) -> Iterator[tuple[int, list[int]]]:
    doc_id = 0
    for chunk in _chunks(documents):
        out = tokenizer(chunk, add_special_tokens=False, verbose=False, return_attention_mask=False,
                        return_token_type_ids=False)["input_ids"]
        for tokens in out:
            yield doc_id, tokens
            doc_id += 1


def _chunks(documents: Iterable[str]) -> Iterator[list[str]]:
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


def _sequence(seq_id: int, policy: PackPolicy, context: int, ids: list[int], docs: list[int],
              positions: list[int]) -> PackedSequence:
    lead = 0 if policy.start_id is None else 1
    pad = context - lead - len(ids)
    return PackedSequence(
        seq_id,
        input_ids=torch.tensor([policy.start_id] * lead + ids + [policy.pad_id] * pad),
        attention_mask=torch.tensor([1] * (context - pad) + [0] * pad),
        doc_ids=torch.tensor([-1] * lead + docs + [-1] * pad),
        doc_positions=torch.tensor([-1] * lead + positions + [-1] * pad),
        special_mask=torch.tensor([True] * lead + [d == -1 for d in docs] + [False] * pad),
    )


def batches(sequences: Iterable[PackedSequence], batch_size: int, *,
            drop_last: bool = False) -> Iterator[dict[str, torch.Tensor]]:
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
    out = {k: torch.stack([getattr(s, k) for s in group])
           for k in ("input_ids", "attention_mask", "doc_ids", "doc_positions", "special_mask")}
    out["seq_ids"] = torch.tensor([s.seq_id for s in group])
    return out
