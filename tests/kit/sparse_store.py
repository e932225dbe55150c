"""A store of synthetic activations with a known sparse structure, for the SAE trainer tests:
each row is a sum of 3 of 64 fixed unit directions in 32 dimensions (with random weights), so a
sparse autoencoder with enough features can explain most of its variance in a few hundred steps."""

from __future__ import annotations

from pathlib import Path

import torch

from hookscope.store import ShardWriter, open_store

POINT = "blocks.1.resid_post"
D, ATOMS, ACTIVE = 32, 64, 3


def sparse_rows(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    fixed = torch.Generator().manual_seed(99)
    atoms = torch.nn.functional.normalize(torch.randn(ATOMS, D, generator=fixed), dim=1)
    picks = torch.rand(n, ATOMS, generator=g).argsort(dim=1)[:, :ACTIVE]
    weights = 1 + torch.rand(n, ACTIVE, generator=g) * 2
    return torch.einsum("na,nad->nd", weights, atoms[picks])


def make_sparse_store(out: Path, rows: int = 4096, context: int = 16, dtype=torch.float32):
    """`rows` rows in whole sequences of `context` tokens (shards of 1024 rows)."""
    x = sparse_rows(rows).to(dtype)
    settings = {"model": "tiny/sparse-model", "points": [POINT], "context": context, "dtype": str(dtype)[6:]}
    per_batch = 4 * context
    with ShardWriter(out, settings, shard_rows=1024) as w:
        for b in range(rows // per_batch):
            s = slice(b * per_batch, (b + 1) * per_batch)
            w.write(
                b,
                {POINT: x[s]},
                {
                    "token_ids": torch.arange(s.start, s.stop) % 500,
                    "seq_ids": torch.arange(b * 4, b * 4 + 4).repeat_interleave(context),
                },
            )
    return open_store(out)


def fvu(reconstruct, x: torch.Tensor) -> float:
    """Fraction of variance unexplained by `reconstruct` on rows `x`."""
    with torch.no_grad():
        return float((reconstruct(x) - x).pow(2).sum() / (x - x.mean(0)).pow(2).sum())
