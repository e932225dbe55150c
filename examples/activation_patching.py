"""Activation patching: which layer, token position and head carry the difference between two prompts?

Run a clean and a corrupted prompt (same length, one word swapped), then run the corrupted prompt
again with one activation copied in from the clean run, and measure how much of the clean score
comes back:

    restored = (patched - corrupted) / (clean - corrupted)     # 0: no effect, 1: all of it

The score is a logit difference, answer A minus answer B at the last position, for a model with an
LM head. An encoder has no logits (the bundled all-MiniLM-L6-v2 is one): there the score is the
sentence embedding (final hidden states, mean-pooled) projected on embedding(A) - embedding(B).
Either way everything after the last block is per position and linear in it, so at the last layer
the per-position effects add up to exactly 1 (for an LM all of it sits at the last position).

    python examples/activation_patching.py [--model PATH] [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from matplotlib.figure import Figure

import hookscope as hs


def make_score(model, tokenizer, answers: list[str]):
    """score(model output) -> a float: higher means answer A over answer B."""
    if model.get_output_embeddings() is not None:  # an LM head
        a, b = (tokenizer(x, add_special_tokens=False).input_ids[0] for x in answers)
        return lambda out: float(out.logits[0, -1, a] - out.logits[0, -1, b])

    def embed(text: str) -> torch.Tensor:
        ids = tokenizer(text, return_tensors="pt").input_ids
        return model(ids).last_hidden_state[0].mean(0)

    with torch.no_grad():
        direction = embed(answers[0]) - embed(answers[1])
    return lambda out: float(out.last_hidden_state[0].mean(0) @ direction)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="Hugging Face id or directory (default: the bundled MiniLM)")
    p.add_argument("--clean", default="When Mary and John went to the store, John gave a drink to")
    p.add_argument("--corrupted", default="When Mary and John went to the store, Mary gave a drink to")
    p.add_argument("--answers", nargs=2, default=[" Mary", " John"], metavar=("A", "B"))
    p.add_argument("--out", default="out/activation_patching", help="where the picture goes")
    args = p.parse_args(argv)

    model, tok, arch = hs.load(args.model)
    clean, corrupted = (tok(t, return_tensors="pt").input_ids for t in (args.clean, args.corrupted))
    if clean.shape != corrupted.shape:
        raise SystemExit(
            f"the prompts must have the same number of tokens, not {clean.shape[1]} and "
            f"{corrupted.shape[1]}: swap words that tokenize alike"
        )
    score = make_score(model, tok, args.answers)
    n_layers, n_heads, n_pos = arch.n_layers, arch.n_heads, clean.shape[1]

    with torch.inference_mode():
        clean_score, corrupted_score = score(model(clean)), score(model(corrupted))
        if clean_score == corrupted_score:
            raise SystemExit("the two prompts score the same: there is nothing to restore")
        source = hs.collect(model, clean, ["blocks.*.resid_post", "blocks.*.attn.z"])

        def restored(*edits) -> float:
            with hs.edit(model, *edits):
                patched = score(model(corrupted))
            return (patched - corrupted_score) / (clean_score - corrupted_score)

        by_position = torch.tensor(
            [
                [
                    restored(hs.patch(f"blocks.{L}.resid_post", source, positions=[pos]))
                    for pos in range(n_pos)
                ]
                for L in range(n_layers)
            ]
        )
        by_head = torch.tensor(
            [
                [restored(hs.patch(f"blocks.{L}.attn.z", source, heads=[h])) for h in range(n_heads)]
                for L in range(n_layers)
            ]
        )

    print(f"score: clean {clean_score:+.4f}, corrupted {corrupted_score:+.4f}")
    print(
        f"last layer, last position restores {by_position[-1, -1]:.4f} of it; "
        f"the last layer's positions add up to {by_position[-1].sum():.4f}"
    )
    for L in range(n_layers):
        best = int(by_position[L].abs().argmax())
        print(
            f"  layer {L}: strongest position {best} ({by_position[L, best]:+.3f}), "
            f"strongest head {int(by_head[L].abs().argmax())} ({by_head[L].abs().max():.3f})"
        )

    tokens = [t.replace("Ġ", " ") for t in tok.convert_ids_to_tokens(clean[0])]
    changed = (clean[0] != corrupted[0]).tolist()
    labels = [
        f"{t}/{tok.convert_ids_to_tokens(int(c))}" if d else t
        for t, c, d in zip(tokens, corrupted[0], changed, strict=True)
    ]
    fig = Figure(figsize=(max(7.0, 0.45 * n_pos + 3), 3 + 0.35 * n_layers), layout="constrained")
    ax_pos, ax_head = fig.subplots(1, 2, width_ratios=[n_pos, max(n_heads, 4)])
    limit = max(1.0, float(by_position.abs().max()), float(by_head.abs().max()))
    panels = [
        (ax_pos, by_position, labels, "patch blocks.L.resid_post at one position"),
        (ax_head, by_head, range(n_heads), "patch blocks.L.attn.z of one head"),
    ]
    for ax, grid, xlabels, title in panels:
        image = ax.imshow(grid.numpy(), cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto")
        ax.set_xticks(range(len(grid[0])), xlabels, rotation=90, fontsize=8)
        ax.set_yticks(range(n_layers))
        ax.set_ylabel("layer")
        ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax_head, label="fraction of the clean score restored")
    fig.suptitle(f"Activation patching, clean -> corrupted ({Path(args.model or 'all-MiniLM-L6-v2').name})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "activation_patching.png", dpi=100)
    print(f"picture: {out / 'activation_patching.png'}")
    return {
        "clean": clean_score,
        "corrupted": corrupted_score,
        "by_position": by_position,
        "by_head": by_head,
        "picture": out / "activation_patching.png",
    }


if __name__ == "__main__":
    main()
