"""Linear probes: at which layer does the last token know what the sentence was about?

Sentences are built from templates around one word from one of two sets (animals or vehicles);
the label is the set. The word sits mid-sentence, so the last token has to pick it up through
attention. We capture the last real token's residual stream at every layer (one forward pass,
right-padded batch, per-row positions), fit a logistic-regression probe per layer, and test it
on two held-out sets, both balanced (chance is 50%):

    new sentences   30% of each class's sentences; their words were seen in training
    new words       every sentence of 2 animals and 2 vehicles never seen in training

    python examples/linear_probe.py [--model PATH] [--out DIR]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from matplotlib.figure import Figure

import hookscope as hs

ANIMALS = ["cat", "dog", "horse", "bird", "fox", "cow", "sheep", "mouse"]
VEHICLES = ["car", "bus", "train", "truck", "boat", "plane", "bike", "van"]
UNSEEN = {"sheep", "mouse", "bike", "van"}  # the "new words" test set
TEMPLATES = [
    "The {} is here.",
    "I saw a {} today.",
    "A {} was outside.",
    "Look at that {} now.",
    "My {} is old.",
    "We found the {} again.",
    "Is the {} yours?",
    "Her {} was fast.",
    "That {} looks tired.",
    "Our {} came back.",
]


def sentences() -> tuple[list[str], torch.Tensor, list[str]]:
    """Every template with every word: (texts, labels 0 = animal / 1 = vehicle, the word of each)."""
    rows = [
        (t.format(w), label, w)
        for label, words in enumerate([ANIMALS, VEHICLES])
        for t in TEMPLATES
        for w in words
    ]
    texts, labels, words = zip(*rows, strict=True)
    return list(texts), torch.tensor(labels, dtype=torch.float32), list(words)


def splits(labels: torch.Tensor, words: list[str], seed: int) -> dict[str, tuple[list[int], list[int]]]:
    """{test set name: (train rows, test rows)}."""
    rng = random.Random(seed)
    train, test = [], []
    for label in (0.0, 1.0):  # split each class alike, so both halves stay balanced
        rows = [i for i, y in enumerate(labels.tolist()) if y == label]
        rng.shuffle(rows)
        cut = int(0.7 * len(rows))
        train, test = train + rows[:cut], test + rows[cut:]
    seen, unseen = ([i for i, w in enumerate(words) if (w in UNSEEN) == new] for new in (False, True))
    return {"new sentences": (train, test), "new words": (seen, unseen)}


def fit_probe(x: torch.Tensor, y: torch.Tensor, l2: float = 1e-3) -> torch.nn.Linear:
    """Logistic regression by L-BFGS on standardised features (the probe keeps the scaling)."""
    mean, std = x.mean(0), x.std(0) + 1e-6
    probe = torch.nn.Linear(x.shape[1], 1)
    opt = torch.optim.LBFGS(probe.parameters(), max_iter=200, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(probe((x - mean) / std).squeeze(1), y)
        loss = loss + l2 * probe.weight.square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():  # fold the standardisation into the weights
        probe.weight /= std
        probe.bias -= (probe.weight * mean).sum()
    return probe


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="Hugging Face id or directory (default: the bundled MiniLM)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="out/linear_probe", help="where the picture goes")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)

    model, tok, arch = hs.load(args.model)
    texts, labels, words = sentences()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    batch = tok(texts, return_tensors="pt", padding=True)
    last = batch["attention_mask"].sum(1) - 1  # the last real token of each row
    points = ["blocks.0.resid_pre"] + [f"blocks.{L}.resid_post" for L in range(arch.n_layers)]
    acts = hs.collect(model, dict(batch), points, positions=last)  # {point: [sentences, d_model]}

    test_sets = splits(labels, words, args.seed)
    accuracy: dict[str, dict[str, float]] = {name: {} for name in test_sets}
    print(f"held-out accuracy ({len(texts)} sentences; chance is 50%):")
    print(f"{'point':22s} " + " ".join(f"{name:>14s}" for name in test_sets))
    for point in points:
        x = acts[point].float()
        for name, (train, test) in test_sets.items():
            probe = fit_probe(x[train], labels[train])
            with torch.no_grad():
                predicted = (probe(x[test]).squeeze(1) > 0).float()
            accuracy[name][point] = float((predicted == labels[test]).float().mean())
        print(f"{point:22s} " + " ".join(f"{accuracy[name][point]:14.1%}" for name in test_sets))

    fig = Figure(figsize=(6.5, 3.8), layout="constrained")
    ax = fig.add_subplot()
    for (name, (_, test)), style in zip(test_sets.items(), ["o-", "s--"], strict=True):
        ax.plot(
            range(len(points)), list(accuracy[name].values()), style, label=f"{name} ({len(test)} sentences)"
        )
    ax.axhline(0.5, color="#999999", linestyle=":", label="chance")
    ax.set_xticks(
        range(len(points)),
        ["embeddings"] + [f"after block {L}" for L in range(arch.n_layers)],
        rotation=30,
        ha="right",
        fontsize=8,
    )
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("held-out accuracy")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(
        "Animal or vehicle? A linear probe on the last token's residual stream\n"
        f"({Path(args.model or 'all-MiniLM-L6-v2').name})",
        fontsize=9,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "linear_probe.png", dpi=100)
    print(f"picture: {out / 'linear_probe.png'}")
    return {
        "accuracy": accuracy,
        "features": acts,
        "labels": labels,
        "texts": texts,
        "splits": test_sets,
        "picture": out / "linear_probe.png",
    }


if __name__ == "__main__":
    main()
