"""Helpers shared by the test files: token ids, a corpus on disk, the extract command line, shard
digests, a tiny HookedTransformer, and reference captures through plain torch hooks (independent of
hookscope: the reference the tests compare hookscope with). Fixtures shared by every file are in
conftest.py; this module has no fixtures of its own, only `corpus_fixture`, which makes one.
"""

from __future__ import annotations

import hashlib
import random
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda fox dog cat residual stream "
    "layer head token sparse feature probe gradient hook model"
).split()

# -- token ids -------------------------------------------------------------------------------------


def vocab_size(model: Any) -> int:
    """The vocabulary of a Hugging Face model (config.vocab_size) or a TransformerLens one (cfg.d_vocab)."""
    cfg = getattr(model, "cfg", None)  # TransformerLens first: a bridge may carry an HF config too
    return cfg.d_vocab if cfg is not None and hasattr(cfg, "d_vocab") else model.config.vocab_size


def token_ids(
    model: Any,
    batch: int = 2,
    length: int = 7,
    seed: int = 0,
    low: int = 1,
    device: str | torch.device = "cpu",
) -> Tensor:
    """Random token ids valid for `model`, the same for the same seed; from `low` (default 1: id 0 is
    the pad / BOS token of the tiny models)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab_size(model), (batch, length), generator=g).to(device)


# -- a corpus and the extract command line ---------------------------------------------------------


def write_corpus(path: Path, docs: int = 60, seed: int = 0) -> Path:
    """`docs` paragraphs of 3-40 words, the same for the same seed."""
    rng = random.Random(seed)
    paras = [
        f"Document {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) + "."
        for i in range(docs)
    ]
    path.write_text("\n\n".join(paras) + "\n")
    return path


def corpus_fixture(docs: int) -> Callable[..., Path]:
    """A module-scoped `corpus` fixture of `docs` paragraphs: `corpus = corpus_fixture(40)`."""

    @pytest.fixture(scope="module")
    def corpus(tmp_path_factory) -> Path:
        return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt", docs=docs)

    return corpus


def extract_cli_args(model: Path | str, corpus: Path, out: Path | str, **overrides: str) -> list[str]:
    """`hookscope extract` arguments for a small run on a tiny model; `overrides`: {"--flag": value}."""
    opts = {
        "--points": "blocks.1.resid_post,blocks.0.mlp.post",
        "--data": str(corpus),
        "--context": "32",
        "--batch-size": "4",
        "--dtype": "float16",
        "--shard-rows": "150",
        **overrides,
    }
    flags = [x for kv in opts.items() for x in kv]
    return ["extract", str(model), "--out", str(out), *flags, "--no-progress"]


def shard_digests(out: Path) -> dict[str, str]:
    """SHA-256 of every file under shards/ (debris included: a clean store has none)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((out / "shards").iterdir())}


# -- models and references -------------------------------------------------------------------------


def tiny_hooked_transformer(
    n_layers: int = 2,
    d_model: int = 32,
    n_heads: int = 4,
    d_vocab: int = 100,
    n_ctx: int = 32,
    seed: int | None = 0,
    **flags: Any,
) -> nn.Module:
    """A random TransformerLens 3 HookedTransformer (GELU MLP, d_head = d_model / n_heads), in eval mode."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(
        n_layers=n_layers,
        d_model=d_model,
        n_heads=n_heads,
        d_head=d_model // n_heads,
        d_vocab=d_vocab,
        n_ctx=n_ctx,
        act_fn="gelu",
        seed=seed,
        **flags,
    )
    return HookedTransformer(cfg).eval()


def first(x: Any) -> Tensor:
    """A module's output tensor: element 0 of a tuple (transformers 4.x blocks), else the output itself."""
    return x[0] if isinstance(x, tuple) else x


def plain_hooks(
    model: nn.Module,
    taps: Mapping[str, tuple[nn.Module, str, Callable[[Any], Tensor]]],
    run: Callable[[], Any],
) -> dict[str, Tensor]:
    """The reference capture: `run()` (one forward pass) under plain `register_forward_hook` ("output")
    or `register_forward_pre_hook` ("input": the first positional argument or `hidden_states`) on each
    tap's module; returns detached copies of `read(tensor)` by tap name, the hooks removed."""
    got: dict[str, Tensor] = {}
    handles = []
    for name, (module, side, read) in taps.items():
        if side == "output":

            def on_output(mod, args, output, name=name, read=read):
                got[name] = read(output).detach().clone()

            handles.append(module.register_forward_hook(on_output))
        else:

            def on_input(mod, args, kwargs, name=name, read=read):
                got[name] = read(args[0] if args else kwargs["hidden_states"]).detach().clone()

            handles.append(module.register_forward_pre_hook(on_input, with_kwargs=True))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return got


# -- counting the work instead of timing it --------------------------------------------------------


def count_connections(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Record the address of every TCP connection attempted from now on (attempts still go ahead): a
    test of "fails fast" counts the attempts, where a clock on a shared machine would be flaky."""
    attempts: list[Any] = []
    connect = socket.socket.connect

    def counted(sock: socket.socket, address: Any) -> None:
        attempts.append(address)
        return connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", counted)
    return attempts
