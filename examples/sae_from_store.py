"""Train a sparse autoencoder on stored activations, and resume it exactly from a checkpoint.

1. Extract `blocks.L.resid_post` of a corpus into a sharded store (`hookscope extract`, here through
   its Python API). Running the script again finds the store complete and skips the work.
2. Train a small SAE (ReLU encoder, linear decoder, L1 penalty on the features) from
   `hs.open_store(...).dataset(...)`: rows shuffled across shards, memory-mapped.
3. Halfway, save a checkpoint: SAE weights, optimizer state and the reader's cursor
   (`data.state_dict()`). Then restart from that checkpoint in fresh objects, as after a crash: the
   resumed run sees the same batches and reaches the same losses, bit for bit.

    python examples/sae_from_store.py [--model PATH] [--tokens N] [--steps N] [--out DIR]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch import nn

import hookscope as hs
from hookscope.extract import ExtractConfig, extract


class SparseAutoencoder(nn.Module):
    def __init__(self, d_model: int, n_features: int):
        super().__init__()
        self.encoder = nn.Linear(d_model, n_features)
        self.decoder = nn.Linear(n_features, d_model)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = F.relu(self.encoder(x - self.decoder.bias))
        return self.decoder(features), features


def forever(data):
    """Batches across epochs: the dataset moves to the next epoch (a new order) by itself."""
    while True:
        yield from data


def train(sae, opt, data, steps: range, *, l1: float, scale: float, checkpoint: Path | None = None,
          checkpoint_at: int | None = None) -> list[float]:
    """Train for `steps`; returns the reconstruction loss (fraction of variance unexplained) per step."""
    losses = []
    # zip(steps, ...) with the range first: no batch is drawn after the last step
    for step, x in zip(steps, forever(data)):  # noqa: B905 (forever() never ends)
        x = x.float() * scale
        recon, features = sae(x)
        mse = (recon - x).square().sum(-1).mean()
        # L1 weighted by the decoder's column norms: shrinking features and growing the decoder gains nothing
        loss = mse + l1 * (features * sae.decoder.weight.norm(dim=0)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(mse.detach() / (x - x.mean(0)).square().sum(-1).mean()))
        if step + 1 == checkpoint_at:
            state = {"sae": sae.state_dict(), "opt": opt.state_dict(), "data": data.state_dict()}
            torch.save(state, checkpoint)
    return losses


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="Hugging Face id or directory (default: the bundled MiniLM)")
    p.add_argument("--layer", type=int, default=3)
    p.add_argument("--data", default="builtin:stdlib-docstrings", help="as for hookscope extract")
    p.add_argument("--tokens", type=int, default=50_000, help="tokens to extract")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--shard-rows", type=int, default=16384)
    p.add_argument("--expansion", type=int, default=4, help="features per model dimension")
    p.add_argument("--l1", type=float, default=3.0, help="sparsity penalty")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--out", default="out/sae_from_store")
    args = p.parse_args(argv)
    out = Path(args.out)
    point = f"blocks.{args.layer}.resid_post"

    summary = extract(ExtractConfig(out=str(out / "store"), model=args.model, points=[point], data=args.data,
                                    context=args.context, dtype="float32", max_tokens=args.tokens,
                                    shard_rows=args.shard_rows, progress=False))
    print(summary)
    store = hs.open_store(out / "store")
    d_model = store.points[point].shape[0]
    scale = math.sqrt(d_model) / store.stats[point].norm_mean  # rows of norm ~sqrt(d): entries ~1

    def fresh(seed: int):
        torch.manual_seed(seed)
        sae = SparseAutoencoder(d_model, args.expansion * d_model)
        opt = torch.optim.Adam(sae.parameters(), lr=1e-3)
        data = store.dataset(point, shuffle=True, seed=0, batch_size=args.batch_size, drop_last=True)
        return sae, opt, data

    half, checkpoint = args.steps // 2, out / "checkpoint.pt"
    sae, opt, data = fresh(seed=0)
    losses = train(sae, opt, data, range(args.steps), l1=args.l1, scale=scale,
                   checkpoint=checkpoint, checkpoint_at=half)

    # "crash" and resume: new objects, a different seed, everything restored from the checkpoint
    sae2, opt2, data2 = fresh(seed=1)
    state = torch.load(checkpoint, weights_only=True)
    sae2.load_state_dict(state["sae"])
    opt2.load_state_dict(state["opt"])
    data2.load_state_dict(state["data"])
    resumed = train(sae2, opt2, data2, range(half, args.steps), l1=args.l1, scale=scale)

    window = max(1, args.steps // 20)
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    with torch.no_grad():
        x = next(iter(store.dataset(point, seed=1, batch_size=4096))).float() * scale
        active = float((sae(x)[1] > 0).float().sum(-1).mean())
    print(f"{len(store):,} rows of {point}, SAE {d_model} -> {args.expansion * d_model} features")
    print(f"reconstruction loss (fraction of variance unexplained): {first:.4f} over the first {window} "
          f"steps, {last:.4f} over the last {window}; {active:.1f} features active per token")
    same = resumed == losses[half:]
    cursors = [(d.state_dict()["epoch"], d.state_dict()["position"]) for d in (data, data2)]
    print(f"resumed from step {half}: {'the same' if same else 'DIFFERENT'} {len(resumed)} losses as the "
          f"uninterrupted run; reader cursor (epoch, row) at the end: {cursors[0]} vs {cursors[1]}")

    fig = Figure(figsize=(6.5, 3.6), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(range(args.steps), losses, color="#4C72B0", lw=1, label="uninterrupted run")
    ax.plot(range(half, args.steps), resumed, color="#DD8452", lw=1, ls="--", label=f"resumed at step {half}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("fraction of variance unexplained")
    ax.legend(fontsize=8)
    ax.set_title(f"SAE on {point} ({Path(args.model or 'all-MiniLM-L6-v2').name}, {len(store):,} tokens)\n"
                 f"{active:.0f} of {args.expansion * d_model} features active per token", fontsize=9)
    fig.savefig(out / "sae_loss.png", dpi=100)
    print(f"picture: {out / 'sae_loss.png'}")
    return {"losses": losses, "resumed": resumed, "half": half, "active_features": active,
            "cursor": data.state_dict(), "resumed_cursor": data2.state_dict(),
            "picture": out / "sae_loss.png"}


if __name__ == "__main__":
    main()
