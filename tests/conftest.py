"""Shared fixtures: tiny random models of every family, saved to disk and loaded back by path
(the same code path a hub model takes), and the real bundled all-MiniLM-L6-v2.

Models are session-scoped and shared, so a test that attaches hooks must remove them (most
tests check exactly that). Tests that change a model's state (frozen weights) build their own.

The tests sit in one folder per room (core, store, extract, sources, families, generate, top,
faults, docs); the helpers they share sit in tests/kit/, on the path through pyproject.toml's
`pythonpath` (`from helpers import token_ids`). The folders are no packages: pytest imports each
test file by its base name, so a file's name must be unique across the folders.

Two markers say what a run leaves out:
- `slow`: a test that takes long (a kill and resume, torchrun, a browser, the docs site, a big
  sweep). The whole suite runs it; the day-to-day tier `pytest -m "not slow"` leaves it out.
- `full`: a point of a sweep at full size (a fault sweep, inductor on every family), run only with
  `pytest --full` (and slow, so the fast tier leaves it out with --full too).
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
    parser.addoption("--full", action="store_true", help="run the sweeps at full size (slow)")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: a `full` test is `slow` there too
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="a full-size sweep: run with --full")
    for item in items:
        if item.get_closest_marker("full") is not None:
            item.add_marker(pytest.mark.slow)
            if not config.getoption("--full"):
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
