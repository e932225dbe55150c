"""The one gate (tests/kit/gate.py), run as CI runs it: pytest in a subprocess over small test files that
need fake packages, with and without HOOKSCOPE_REQUIRE naming them. A required package that is
missing (or of the wrong major version) must be an error, never a skip."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import gate
import pytest

KIT = Path(__file__).resolve().parents[1] / "kit"  # gate.py
ROOT = Path(__file__).resolve().parents[2]

CONFTEST = """
import gate
gate.NEEDS["fake_missing"] = gate.Need("a fake package", "nowhere", ("hookscope_no_such_module",))
gate.NEEDS["fake_there"] = gate.Need("json, always there", "anywhere", ("json",))
gate.NEEDS["fake_old"] = gate.Need("pytest 0.x", "nowhere", ("pytest",), dist="pytest", major="0")
"""
FILES = {
    "test_missing.py": "import gate\ngate.need('fake_missing')\n\ndef test_a():\n    pass\n",
    "test_inside.py": "import gate\n\ndef test_b():\n    gate.need('fake_missing')\n",
    "test_there.py": (
        "import gate\njson = gate.need('fake_there')\n\ndef test_c():\n    assert json.dumps(1) == '1'\n"
    ),
    "test_old.py": "import gate\ngate.need('fake_old')\n\ndef test_d():\n    pass\n",
    "test_mark.py": (
        "import gate\n\n@gate.skip_unless('fake_missing')\ndef test_e():\n    pass\n\n"
        "@gate.skip_unless('fake_there')\ndef test_f():\n    pass\n"
    ),
}


def run_pytest(folder: Path, require: str) -> tuple[int, str]:
    """pytest over `folder` (going on past collection errors, to see every file's outcome)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(KIT), os.environ.get("PYTHONPATH", "")]),
        gate.ENV_VAR: require,
        "COLUMNS": "1000",
    }  # summary lines whole
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rfEs",
            "-p",
            "no:cacheprovider",
            "--continue-on-collection-errors",
            str(folder),
        ],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, done.stdout + done.stderr


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gate")
    (root / "conftest.py").write_text(CONFTEST)
    for name, text in FILES.items():
        (root / name).write_text(text)
    return root


@pytest.mark.slow
def test_without_require_a_missing_package_skips_naming_its_environment(folder):
    code, out = run_pytest(folder, "")
    # missing module-level, missing inside a test, the wrong version, and one mark: skipped; json: passes
    assert code == 0, out
    assert "2 passed, 4 skipped" in out, out
    assert "needs a fake package" in out and "`scripts/test-all nowhere` runs it" in out
    assert "pytest is " in out and "not 0.x" in out


@pytest.mark.slow
def test_a_required_package_that_is_missing_is_an_error(folder):
    code, out = run_pytest(folder, "fake_missing,fake_there,fake_old")
    assert code != 0, out
    # each file that needs a missing or wrong package fails; nothing is skipped
    assert "skipped" not in out, out
    missing = (
        "HOOKSCOPE_REQUIRE names fake_missing (a fake package) but importing hookscope_no_such_module failed"
    )
    for name in ("test_missing.py", "test_inside.py::test_b", "test_mark.py"):
        assert any(name in line and missing in line for line in out.splitlines()), (name, out)
    assert "HOOKSCOPE_REQUIRE names fake_old (pytest 0.x) but pytest is" in out
    assert "1 failed, 1 passed, 3 errors" in out, out  # test_inside fails; test_c passes; 3 modules error


def test_an_unknown_name_in_require_is_an_error(monkeypatch):
    monkeypatch.setenv(gate.ENV_VAR, "tl3, sae-lens")
    with pytest.raises(ValueError, match=r"names \['sae-lens'\]: not one of"):
        gate.required()
    monkeypatch.setenv(gate.ENV_VAR, "tl3, sae_lens,cuda")
    assert gate.required() == {"tl3", "sae_lens", "cuda"}


def test_each_environment_requires_what_it_installs():
    """Every environment of scripts/test-all sets HOOKSCOPE_REQUIRE, to names the gate knows, and each
    name is required by the environment the gate sends its skips to."""
    script = (ROOT / "scripts" / "test-all").read_text().replace("\\\n", " ")
    statements = [line for line in script.splitlines() if re.search(r"\benv_run [a-z0-9]+ ", line)]
    required = {}
    for line in statements:
        found = re.search(rf"{gate.ENV_VAR}=(\S*)", line)
        assert found, f"an environment of scripts/test-all requires nothing explicitly: {line}"
        env = re.search(r"\benv_run ([a-z0-9]+) ", line).group(1)
        required[env] = {n for n in found.group(1).split(",") if n}
    assert {"base", "main", "tl4", "dictlearn", "floor"} <= required.keys()
    gpu_suite = (ROOT / "scripts" / "gpu-suite").read_text()
    required["gpu-suite"] = set(re.search(rf"{gate.ENV_VAR}=(\S+)", gpu_suite).group(1).split(","))
    for name, need in gate.NEEDS.items():
        assert name in required[need.env], f"{need.env} installs {name} but does not require it"
    assert set().union(*required.values()) == gate.NEEDS.keys()
