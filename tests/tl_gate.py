"""The TransformerLens version gate of the TL test modules.

TransformerLens 3.x (`HookedTransformer`) and 4.x (`TransformerBridge`) cannot share a venv, so each
TL suite runs in its own environment (scripts/test-all). There, HOOKSCOPE_REQUIRE_TL names the
major version the environment must have: a missing or wrong TransformerLens fails instead of
skipping. Anywhere else a module whose version is absent skips, saying which environment runs it.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

import pytest


def require_transformer_lens(major: str, what: str, env: str) -> str:
    """The installed TransformerLens version, if its major version is `major`; otherwise fail (in the
    environment `env` that must have it) or skip the calling module. `what`: its API, for the message."""
    try:
        version: str | None = importlib.metadata.version("transformer-lens")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if os.environ.get("HOOKSCOPE_REQUIRE_TL") == major:
        assert version is not None and version.startswith(f"{major}."), (
            f"the {env} test environment must have TransformerLens {major}.x, found {version}")
    elif version is None or not version.startswith(f"{major}."):
        module = Path(sys._getframe(1).f_globals.get("__file__", "this module")).name  # pytest names the gate
        pytest.skip(f"{module} needs TransformerLens {major}.x ({what}); this environment has "
                    f"{version or 'no TransformerLens'}: run `scripts/test-all {env}`",
                    allow_module_level=True)
    assert version is not None
    return version
