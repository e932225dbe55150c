"""A synthetic store for the top-k tests, written with the real ShardWriter from real tokenized text.

Documents are tokenized by a tiny saved model's own tokenizer and packed into sequences by hand
(a sequence may hold the end of one document and the start of the next, as hookscope extract packs
them), so every row's (token, document, position, sequence) is known here independently of the
code under test. Units of the point `blocks.0.mlp.post` (12 of them, float16):

- unit 3 is planted: ~6 on every occurrence of TARGET (a chosen token), small noise elsewhere;
- unit 5 takes only the values 0, 0.5, 1 and 1.5: many exact ties, at the k-th place for every k tested;
- unit 7 is dead (all zeros): every row ties;
- the others are plain noise (float16 makes some ties too).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from hookscope.store import ShardWriter, open_store
from hookscope.testing import save_tiny

POINT = "blocks.0.mlp.post"
UNITS = 12
PLANTED, TIED, DEAD = 3, 5, 7
CONTEXT = 16  # tokens per packed sequence
BATCH = 4  # sequences per batch

_WORDS = (
    "the quick brown fox jumps over lazy dog interpretability researchers read residual stream one "
    "layer at a time sparse autoencoder learns dictionary of features from activations hooks attach "
    "to modules Paris is capital France and Rome Italy"
).split()


@dataclass
class Synthetic:
    path: Path
    model_dir: Path
    tokenizer: object
    target: int  # the token id unit 3 fires on
    docs: list[list[int]]  # each document's token ids
    rows: list[tuple[int, int, int]]  # per store row: (doc, position, seq)
    settings: dict


def documents(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 30))) + "." for _ in range(n)]


def make_store(root: Path, *, n_docs: int = 40, seed: int = 0, shard_rows: int = 150) -> Synthetic:
    model_dir = save_tiny("gpt2", root / "model", d_model=32, n_layers=1, n_heads=2, context=64)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    docs = [tok(t)["input_ids"] for t in documents(n_docs, seed)]
    # pack: documents back to back, cut into sequences of CONTEXT tokens (the last one may be short)
    flat = [(d, p, t) for d, ids in enumerate(docs) for p, t in enumerate(ids)]
    seqs = [flat[i : i + CONTEXT] for i in range(0, len(flat), CONTEXT)]
    counts: dict[int, int] = {}
    for _, _, t in flat:
        counts[t] = counts.get(t, 0) + 1
    # a token seen often, but not the most common one
    target = sorted(counts, key=lambda t: (-counts[t], t))[3]
    settings = {
        "model": str(model_dir),
        "points": [POINT],
        "note": "synthetic top-k test store",
        "seed": seed,
    }
    gen = torch.Generator().manual_seed(seed)
    rows: list[tuple[int, int, int]] = []
    path = root / "store"
    with ShardWriter(path, settings, shard_rows=shard_rows) as writer:
        for b in range(0, len(seqs), BATCH):
            batch = [tok_row for s in seqs[b : b + BATCH] for tok_row in s]
            seq_of = [b + i for i, s in enumerate(seqs[b : b + BATCH]) for _ in s]
            n = len(batch)
            ids = torch.tensor([t for _, _, t in batch])
            x = torch.randn(n, UNITS, generator=gen) * 0.5
            x[:, PLANTED] = torch.where(ids == target, 6 + torch.rand(n, generator=gen), x[:, PLANTED] * 0.2)
            x[:, TIED] = (torch.randn(n, generator=gen) * 2).round().clamp(0, 3) / 2
            x[:, DEAD] = 0
            meta = {
                "token_ids": ids,
                "doc_ids": torch.tensor([d for d, _, _ in batch]),
                "positions": torch.tensor([p for _, p, _ in batch]),
                "seq_ids": torch.tensor(seq_of),
            }
            writer.write(b // BATCH, {POINT: x.half()}, meta)
            rows += [(d, p, s) for (d, p, _), s in zip(batch, seq_of, strict=True)]
    return Synthetic(path, model_dir, tok, target, docs, rows, settings)


def brute_force_top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per unit, the k rows sorted by (value descending, row ascending): plain Python sorting."""
    vals, rows = [], []
    xs = x.float().tolist()
    for u in range(x.shape[1]):
        order = sorted(range(len(xs)), key=lambda r: (-xs[r][u], r))[:k]
        rows.append(order)
        vals.append([xs[r][u] for r in order])
    return torch.tensor(vals), torch.tensor(rows)


def expected_window(syn: Synthetic, row: int, context: int) -> list[int]:
    """Rows around `row` in the same sequence and document, at most `context` on each side."""
    d, _, s = syn.rows[row]
    out = []
    for r in range(max(0, row - context), min(len(syn.rows), row + context + 1)):
        if syn.rows[r][0] == d and syn.rows[r][2] == s:
            out.append(r)
    return out


def reopen(path: Path):
    return open_store(path)
