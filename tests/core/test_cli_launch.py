"""The `hookscope` command runs with OMP_WAIT_POLICY=PASSIVE in effect from torch's load on (unless the
user set it), and `import hookscope` leaves it alone. The evidence is the OpenMP runtime's own: with
OMP_DISPLAY_ENV=verbose, libgomp prints the settings it parsed when it loaded (with torch), and
GOMP_SPINCOUNT is 0 only where PASSIVE was in the environment by then (300,000 unset, 3e10 ACTIVE)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from helpers import extract_cli_args, write_corpus

import hookscope as hs

SRC = Path(hs.__file__).resolve().parents[1]
ENTRY = tomllib.loads((SRC.parent / "pyproject.toml").read_text())["project"]["scripts"]["hookscope"]

pytestmark = pytest.mark.skipif(
    "OpenMP" not in torch.__config__.parallel_info(), reason="torch here does not use OpenMP"
)


def run_python(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    environ |= {
        "OMP_DISPLAY_ENV": "verbose",
        "PYTHONPATH": os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])]),
        **env,
    }
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=environ, timeout=300
    )


def run_command(*args: str, **env: str) -> subprocess.CompletedProcess:
    """`hookscope ARGS` as the installed console script runs it: import the entry point pyproject.toml
    names, call it (what pip's generated script does)."""
    module, attr = ENTRY.split(":")
    return run_python(f"import sys; from {module} import {attr}; sys.exit({attr}())", *args, **env)


def spin_count(stderr: str) -> int:
    found = re.findall(r"GOMP_SPINCOUNT = '(\d+)'", stderr)
    if not found:
        pytest.skip("this OpenMP runtime does not display its settings (not libgomp)")
    return int(found[0])


@pytest.mark.slow
def test_an_extract_runs_with_passive_waits_from_torchs_load(tiny_dirs, tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt", docs=8)
    run = run_command(*extract_cli_args(tiny_dirs["gpt2"], corpus, tmp_path / "store"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert spin_count(run.stderr) == 0, run.stderr[-3000:]
    assert hs.open_store(tmp_path / "store", verify=True).manifest.shards


@pytest.mark.slow
def test_the_command_keeps_a_policy_the_user_set(tmp_path):
    run = run_command("inspect", str(tmp_path / "missing"), OMP_WAIT_POLICY="ACTIVE")
    assert run.returncode == 2 and "hookscope: error:" in run.stderr, run.stderr[-3000:]
    assert spin_count(run.stderr) > 300_000
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in run.stderr


@pytest.mark.slow
def test_importing_hookscope_and_its_cli_leaves_the_policy_alone():
    code = (
        "import os, hookscope, hookscope.cli; hookscope.load; print(repr(os.environ.get('OMP_WAIT_POLICY')))"
    )
    run = run_python(code)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "None"
    assert spin_count(run.stderr) == 300_000  # libgomp's default: the library changed nothing
