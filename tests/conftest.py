"""Shared fixtures: tiny random models of every family, saved to disk and loaded back by path
(the same code path a hub model takes), and the real bundled all-MiniLM-L6-v2.

Models are session-scoped and shared, so a test that attaches hooks must remove them (most
tests check exactly that). Tests that change a model's state (frozen weights) build their own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import token_ids

import hookscope as hs
from hookscope.testing import save_tiny

# name -> (family, config overrides). NeoX is covered with and without a parallel residual.
TINY = {
    "gpt2": ("gpt2", {}),
    "llama": ("llama", {}),
    "neox_parallel": ("gpt_neox", {"use_parallel_residual": True}),
    "neox_sequential": ("gpt_neox", {"use_parallel_residual": False}),
    "bert": ("bert", {}),
}
SIZE = {"d_model": 64, "n_layers": 3, "n_heads": 4, "context": 64}

torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true", help="run the fault sweeps at full size (slow)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--full"):
        skip = pytest.mark.skip(reason="slow: run with --full")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        key: save_tiny(family, root / key, **SIZE, **overrides) for key, (family, overrides) in TINY.items()
    }


@pytest.fixture(scope="session")
def gemma2_dir(tmp_path_factory) -> str:
    """A tiny Gemma 2 (a post-norm family: its `mlp.out` changed meaning) with a tokenizer, saved."""
    import family_models

    from hookscope.testing import train_tokenizer

    path = tmp_path_factory.mktemp("gemma2")
    family_models.build("gemma2").float().save_pretrained(path)
    train_tokenizer(family_models.VOCAB).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny(tiny_dirs) -> dict[str, hs.Loaded]:
    """Every tiny model, loaded by path with `hs.load(path)`."""
    return {key: hs.load(str(path)) for key, path in tiny_dirs.items()}


@pytest.fixture(scope="session")
def minilm() -> hs.Loaded:
    """The real bundled all-MiniLM-L6-v2 (`hs.load()` with no argument)."""
    return hs.load()


@pytest.fixture(scope="session")
def gpt2(tiny) -> torch.nn.Module:
    return tiny["gpt2"].model


@pytest.fixture(scope="session")
def llama(tiny) -> torch.nn.Module:
    return tiny["llama"].model


@pytest.fixture(scope="session")
def make_ids():
    """`make_ids(model, batch=2, length=7, seed=0)`: random valid token ids for a model."""
    return token_ids


@pytest.fixture
def ids(gpt2) -> torch.Tensor:
    return token_ids(gpt2)
