"""Gradient x activation: how much of a loss each layer's residual stream, at each token, accounts for.

For the residual stream `a` after block L and the gradient `g = d loss / d a`, `(g * a).sum(-1)` is
the first-order change of the loss if that token's activation were scaled down to zero. The
script checks the approximation: scaling the whole layer by (1 - eps) must change the loss by
-eps * sum(g * a), up to O(eps^2).

The loss is the language-modelling loss for a model with an LM head; for an encoder (the bundled
all-MiniLM-L6-v2) it is 1 - cosine similarity between the sentence's embedding (mean-pooled final
hidden states, as sentence-transformers does) and a reference sentence's.

    python examples/gradient_attribution.py [--model PATH] [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure

import hookscope as hs


def make_loss(model, tokenizer, text: str, reference: str):
    """(keyword inputs of the model, loss_fn(output) -> scalar tensor)."""
    ids = tokenizer(text, return_tensors="pt").input_ids
    if model.get_output_embeddings() is not None:  # an LM head: predict each next token
        # by hand, not out.loss: transformers computes that in float32 even for a float64 model
        return {"input_ids": ids}, lambda out: F.cross_entropy(out.logits[0, :-1], ids[0, 1:])
    with torch.no_grad():
        target = model(tokenizer(reference, return_tensors="pt").input_ids).last_hidden_state[0].mean(0)

    def loss_fn(out) -> torch.Tensor:  # sentence-transformers' embedding: the mean over tokens
        return 1 - F.cosine_similarity(out.last_hidden_state[0].mean(0), target, dim=0)

    return {"input_ids": ids}, loss_fn


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="Hugging Face id or directory (default: the bundled MiniLM)")
    p.add_argument("--text", default="A man is playing a guitar on the stage in front of a crowd.")
    p.add_argument(
        "--reference",
        default="Someone performs music for an audience.",
        help="encoders only: the sentence the loss compares with",
    )
    p.add_argument("--eps", type=float, default=1e-3, help="the small step of the first-order check")
    p.add_argument("--out", default="out/gradient_attribution", help="where the picture goes")
    args = p.parse_args(argv)

    model, tok, arch = hs.load(args.model)
    model.double()  # float64: the finite-difference check then shows the approximation, not rounding
    inputs, loss_fn = make_loss(model, tok, args.text, args.reference)
    points = [f"blocks.{L}.resid_post" for L in range(arch.n_layers)]

    grads = hs.grads(model, inputs, points, loss_fn)
    acts = hs.collect(model, inputs, points)
    per_token = torch.stack([(grads[pt] * acts[pt]).sum(-1)[0] for pt in points])  # [layer, position]

    with torch.no_grad():
        loss = float(loss_fn(model(**inputs)))
        predicted, measured = [], []
        for L, pt in enumerate(points):
            with hs.edit(model, hs.steer(pt, acts[pt], scale=-args.eps)):  # a -> (1 - eps) a
                measured.append(float(loss_fn(model(**inputs))) - loss)
            predicted.append(-args.eps * float(per_token[L].sum()))

    # errors relative to the largest change: a layer can leave the loss unchanged (a cosine
    # similarity ignores the scale of the last layer's output) and then predicts ~0 too
    scale = max(map(abs, measured))
    errors = [abs(pred - meas) / scale for pred, meas in zip(predicted, measured, strict=True)]
    print(f"loss {loss:.6f}; scaling one layer's residual stream by (1 - {args.eps:g}):")
    for L, (pred, meas, err) in enumerate(zip(predicted, measured, errors, strict=True)):
        print(
            f"  layer {L}: loss change {meas:+.3e}, gradient x activation predicts {pred:+.3e} "
            f"(error {err:.1e} of the largest change)"
        )

    tokens = [t.replace("Ġ", " ") for t in tok.convert_ids_to_tokens(inputs["input_ids"][0])]
    fig = Figure(figsize=(max(7.0, 0.45 * len(tokens) + 4), 2.5 + 0.35 * arch.n_layers), layout="constrained")
    ax_map, ax_sum = fig.subplots(1, 2, width_ratios=[len(tokens), 6])
    limit = float(per_token.abs().max())
    image = ax_map.imshow(per_token.numpy(), cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
    ax_map.set_xticks(range(len(tokens)), tokens, rotation=90, fontsize=8)
    ax_map.set_yticks(range(arch.n_layers))
    ax_map.set_ylabel("layer (blocks.L.resid_post)")
    ax_map.set_title("gradient x activation per token", fontsize=9)
    fig.colorbar(image, ax=ax_map, label="gradient x activation", pad=0.01)
    layers = range(arch.n_layers)
    ax_sum.barh(
        layers, [-m / args.eps for m in measured], color="#BBBBBB", label="measured: -(loss change) / eps"
    )
    ax_sum.plot(per_token.sum(1).numpy(), layers, "o", color="#C44E52", label="sum of gradient x activation")
    ax_sum.set_yticks(layers)
    ax_sum.invert_yaxis()
    ax_sum.set_title("per layer", fontsize=9)
    ax_sum.legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.08))
    fig.suptitle(f"Gradient x activation ({Path(args.model or 'all-MiniLM-L6-v2').name}), loss {loss:.4f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "gradient_attribution.png", dpi=100)
    print(f"picture: {out / 'gradient_attribution.png'}")
    return {
        "loss": loss,
        "per_token": per_token,
        "predicted": predicted,
        "measured": measured,
        "errors": errors,
        "picture": out / "gradient_attribution.png",
    }


if __name__ == "__main__":
    main()
