"""Train a SAELens sparse autoencoder on stored activations, and resume it exactly from a checkpoint.

1. Extract `blocks.L.resid_post` of a corpus into a sharded store (`hookscope extract`, here through
   its Python API). Running the script again finds the store complete and skips the work.
2. Train a SAELens `StandardTrainingSAE` with SAELens's own `SAETrainer`, fed by
   `iter(store.dataset(point, batch_size=B, repeat=True))`: rows shuffled across shards, the next
   window read in the background, epoch after epoch with no hand-written generator. The SAE's
   config names the model and the TransformerLens hook, so SAELens tools know where it belongs.
3. SAELens checkpoints the run halfway (weights, optimizer, activation scaler, counters); its
   `save_checkpoint_fn` adds the reader's cursor (`data.state_dict()`). Restart from it in fresh
   objects, as after a crash: the resumed SAE ends with the same weights, bit for bit, as the
   uninterrupted one.
4. Report SAELens's own metrics (explained variance, L0, MSE) on rows held out of training
   (`split="val"`), before and after training, and a picture of the features' firing rates.

    python examples/sae_from_store.py [--model PATH] [--tokens N] [--steps N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
from matplotlib.figure import Figure
from sae_lens import SAETrainer, StandardTrainingSAE, StandardTrainingSAEConfig
from sae_lens.config import SAETrainerConfig
from sae_lens.saes.sae import SAEMetadata, TrainStepInput

import hookscope as hs
from hookscope.export import tl_hook_name
from hookscope.extract import ExtractConfig, extract


def saelens_metrics(trainer: SAETrainer, x: torch.Tensor) -> dict[str, float]:
    """SAELens's own per-step metrics (`build_train_step_log_dict`) on rows `x`, without training."""
    sae = trainer.sae
    sae.eval()
    with torch.no_grad():
        out = sae.training_forward_pass(
            TrainStepInput(
                sae_in=x,
                dead_neuron_mask=None,
                coefficients=trainer.get_coefficients(),
                n_training_steps=0,
                is_logging_step=False,
            )
        )
    log = trainer.build_train_step_log_dict(out, trainer.n_training_samples)
    keep = ("metrics/explained_variance", "metrics/l0", "losses/mse_loss", "losses/l1_loss")
    return {k.split("/")[1]: float(log[k]) for k in keep if k in log}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="Hugging Face id or directory (default: the bundled MiniLM)")
    p.add_argument("--layer", type=int, default=3)
    p.add_argument("--data", default="builtin:stdlib-docstrings", help="as for hookscope extract")
    p.add_argument("--tokens", type=int, default=50_000, help="tokens to extract")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--shard-rows", type=int, default=16384)
    p.add_argument("--expansion", type=int, default=4, help="features per model dimension")
    p.add_argument("--l1", type=float, default=1.0, help="SAELens's l1_coefficient")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--out", default="out/sae_from_store")
    args = p.parse_args(argv)
    out = Path(args.out)
    point = f"blocks.{args.layer}.resid_post"

    summary = extract(
        ExtractConfig(
            out=str(out / "store"),
            model=args.model,
            points=[point],
            data=args.data,
            context=args.context,
            dtype="float32",
            max_tokens=args.tokens,
            shard_rows=args.shard_rows,
            progress=False,
        )
    )
    print(summary)
    store = hs.open_store(out / "store")
    d_model = store.points[point].shape[0]
    # held-out rows for the metrics: the "val" split never reaches the trainer
    held_out = next(iter(store.dataset(point, split="val", seed=1, batch_size=4096))).float()

    def fresh(seed: int, checkpoints: Path | None = None) -> tuple[SAETrainer, hs.ActivationDataset]:
        torch.manual_seed(seed)
        sae = StandardTrainingSAE(
            StandardTrainingSAEConfig(
                d_in=d_model,
                d_sae=args.expansion * d_model,
                l1_coefficient=args.l1,
                normalize_activations="expected_average_only_in",  # SAELens scales rows to norm sqrt(d_in)
                metadata=SAEMetadata(
                    model_name=store.manifest.settings["model"],
                    hook_name=tl_hook_name(point),
                    context_size=store.manifest.settings["context"],
                ),
            )
        )
        data = store.dataset(
            point, split="train", seed=0, batch_size=args.batch_size, drop_last=True, repeat=True
        )
        cfg = SAETrainerConfig(
            total_training_samples=args.steps * args.batch_size,
            train_batch_size_samples=args.batch_size,
            lr=args.lr,
            lr_end=args.lr,
            n_batches_for_norm_estimate=10,
            dead_feature_window=max(1, args.steps // 4),
            feature_sampling_window=args.steps + 1,
            n_checkpoints=1 if checkpoints else 0,
            checkpoint_path=str(checkpoints) if checkpoints else None,
        )

        def save_cursor(checkpoint_path: Path | None) -> None:  # SAELens calls it after each checkpoint
            (checkpoint_path / "reader.json").write_text(json.dumps(data.state_dict()))

        return SAETrainer(cfg, sae, iter(data), save_checkpoint_fn=save_cursor), data

    # the uninterrupted run; SAELens checkpoints it halfway (weights, optimizer, scaler, counters) and
    # save_cursor adds the reader's cursor to the checkpoint
    checkpoints = out / "checkpoints"
    trainer, data = fresh(seed=0, checkpoints=checkpoints)
    before = saelens_metrics(trainer, held_out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SAELens warns that wandb logging is off
        sae = trainer.fit()
    after = saelens_metrics(trainer, held_out)

    # "crash" and resume: fresh objects (another seed), everything restored from the halfway checkpoint
    (half_dir,) = [p for p in checkpoints.iterdir() if p.is_dir()]
    resumed, resumed_data = fresh(seed=1)
    resumed.sae.load_weights_from_checkpoint(half_dir)
    resumed.load_trainer_state(half_dir)
    resumed_data.load_state_dict(json.loads((half_dir / "reader.json").read_text()))
    resumed.data_provider = iter(resumed_data)  # continues from the restored cursor
    half = resumed.n_training_steps
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed.fit()
    same = all(
        torch.equal(a, b)
        for a, b in zip(sae.state_dict().values(), resumed.sae.state_dict().values(), strict=True)
    )

    sae.save_model(str(out / "sae"))
    saved = json.loads((out / "sae" / "cfg.json").read_text())
    print(
        f"{len(store):,} rows of {point}; SAELens SAE {d_model} -> {args.expansion * d_model} features, "
        f"{args.steps} steps of {args.batch_size} rows "
        f"({args.steps * args.batch_size / len(store):.1f} epochs)"
    )
    print(
        f"SAELens metrics on {len(held_out):,} held-out rows: explained variance "
        f"{before['explained_variance']:.3f} -> {after['explained_variance']:.3f}, "
        f"L0 {before['l0']:.1f} -> {after['l0']:.1f}, "
        f"MSE {before['mse_loss']:.4g} -> {after['mse_loss']:.4g}"
    )
    print(
        f"saved to {out / 'sae'}: model_name={saved['metadata']['model_name']!r}, "
        f"hook_name={saved['metadata']['hook_name']!r}"
    )
    cursors = [(d.state_dict()["epoch"], d.state_dict()["position"]) for d in (data, resumed_data)]
    print(
        f"resumed from step {half}: {'the same' if same else 'DIFFERENT'} final weights as the "
        "uninterrupted "
        f"run; reader cursor (epoch, row) at the end: {cursors[0]} vs {cursors[1]}"
    )

    rates = trainer.log_feature_sparsity  # log10 of each feature's firing rate (SAELens's own)
    fig = Figure(figsize=(6.5, 3.6), layout="constrained")
    ax = fig.add_subplot()
    ax.hist(rates.clamp(min=-10).numpy(), bins=50, color="#4C72B0")
    ax.set_xlabel("log10 firing rate per token (SAELens feature sparsity)")
    ax.set_ylabel("features")
    model_name = Path(args.model or "all-MiniLM-L6-v2").name
    ax.set_title(
        f"SAELens SAE on {point} ({model_name}, {len(store):,} tokens)\n"
        f"held-out explained variance {after['explained_variance']:.3f}, L0 {after['l0']:.1f}",
        fontsize=9,
    )
    fig.savefig(out / "sae_sparsity.png", dpi=100)
    print(f"picture: {out / 'sae_sparsity.png'}")
    dead = int(trainer.dead_neurons.sum())
    return {
        "before": before,
        "after": after,
        "same_weights": same,
        "cursor": data.state_dict(),
        "resumed_cursor": resumed_data.state_dict(),
        "metadata": saved["metadata"],
        "dead": dead,
        "epochs": args.steps * args.batch_size / len(store),
        "picture": out / "sae_sparsity.png",
        "log_feature_sparsity": rates,
    }


if __name__ == "__main__":
    main()
