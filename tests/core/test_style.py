"""One style over the whole tree, checked by the tool that sets it: `ruff format` (no hand-packed
lines, no arguments about where a line breaks) and `ruff check` with the rules in pyproject.toml.
The version is pinned in the `test` extra, so every environment formats alike."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREES = ["src", "tests", "bench", "scripts", "examples", "docs"]


def ruff(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if exe is None:
        pytest.fail("ruff is not installed: it comes with the `test` extra (pip install -e '.[test]')")
    return subprocess.run([exe, *args, *TREES], cwd=ROOT, capture_output=True, text=True)


def test_the_tree_is_formatted_by_ruff():
    done = ruff("format", "--check")
    assert done.returncode == 0, f"run `ruff format {' '.join(TREES)}`:\n{done.stdout}{done.stderr}"


def test_the_tree_passes_ruffs_rules():
    done = ruff("check", "--output-format", "concise")
    assert done.returncode == 0, f"ruff check {' '.join(TREES)}:\n{done.stdout}{done.stderr}"


def test_every_test_file_sits_in_a_room_folder():
    """tests/ holds rooms (core, store, extract, ...) and kit/; a test file dropped at the top is
    in no room and out of the tiers that name folders."""
    stray = sorted(p.name for p in (ROOT / "tests").glob("test_*.py"))
    assert not stray, f"move {stray} into the folder of the room they test (tests/<room>/)"
