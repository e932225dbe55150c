"""The extraction sources the fault tests run over (text, text + generated continuation, images),
so that every interrupt, kill, rejected-run and elastic-resume test is written once and
parametrized over the sources: a `Case` names the model, the data and the options of one source,
as `ExtractConfig` fields and as `hookscope extract` flags."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from faultkit import write_corpus
from PIL import Image

from hookscope.testing import save_tiny

SOURCES = ("text", "generated", "images")
FLAGS = {
    "points": "--points",
    "data": "--data",
    "context": "--context",
    "batch_size": "--batch-size",
    "dtype": "--dtype",
    "shard_rows": "--shard-rows",
    "max_tokens": "--max-tokens",
    "generate": "--generate",
}


def write_images(folder: Path, count: int, seed: int = 0) -> Path:
    """`count` small random pictures of a few sizes (the processor resizes them to 32x32)."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    for i in range(count):
        w, h = (40, 40) if i % 3 else (32, 48)
        pixels = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(folder / f"pic{i:04d}.png")
    return folder


@dataclass(frozen=True)
class Case:
    """One source's run: `fields` are ExtractConfig fields (out and progress aside)."""

    source: str
    fields: dict[str, Any] = field(default_factory=dict)

    def config(self, out: Path, **overrides: Any) -> dict[str, Any]:
        return {**self.fields, "out": str(out), "progress": False, **overrides}

    def cli(self, out: Path, **flags: str) -> list[str]:
        """`hookscope extract` arguments; `flags` ("--batch-size": "0") override the case's."""
        opts = {
            FLAGS[k]: ",".join(v) if isinstance(v, list) else str(v)
            for k, v in self.fields.items()
            if k != "model" and v is not None and v != 0
        }
        opts.update(flags)
        return [
            "extract",
            str(self.fields["model"]),
            "--out",
            str(out),
            *[x for kv in opts.items() for x in kv],
            "--no-progress",
        ]

    def empty_data(self, folder: Path) -> str:
        """A data source that exists and holds nothing to extract."""
        if self.source == "images":
            (folder / "no-images").mkdir(exist_ok=True)
            return f"images:{folder / 'no-images'}"
        (folder / "empty.txt").write_text("")
        return str(folder / "empty.txt")

    def missing_data(self, folder: Path) -> str:
        return f"images:{folder / 'nope'}" if self.source == "images" else str(folder / "nope.txt")


def make_case(
    source: str, tiny_dirs: dict[str, Path], root: Path, *, docs: int = 40, images: int = 40, **fields: Any
) -> Case:
    """A case of `source`: text and generated read a corpus of `docs` paragraphs with the tiny
    GPT-2; images read `images` pictures with a tiny ViT (both written under `root`)."""
    root.mkdir(parents=True, exist_ok=True)
    if source == "images":
        model = root / "vit"
        if not (model / "config.json").exists():
            save_tiny("vit", model, n_layers=2, d_model=32)
        data = f"images:{write_images(root / 'pictures', images)}"
        base = {"model": model, "data": data, "batch_size": 2}
    else:
        corpus = write_corpus(root / "corpus.txt", docs=docs)
        base = {
            "model": tiny_dirs["gpt2"],
            "data": str(corpus),
            "context": 32,
            "batch_size": 4,
            **({"generate": 2} if source == "generated" else {}),
        }
    merged = {**base, **fields}
    merged["model"] = str(merged["model"])
    return Case(source, merged)


class PerSource(dict):
    """source -> `make(source)`, made when a test first asks for it: a reference store is built
    only for the sources the selected tests run."""

    def __init__(self, make: Callable[[str], Any]):
        super().__init__()
        self.make = make

    def __missing__(self, source: str) -> Any:
        self[source] = value = self.make(source)
        return value
