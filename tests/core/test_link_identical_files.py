"""scripts/link-identical-files: test environments share identical installed files through hard links.

Built on hand-made environments: what must become one file (identical bytes, across the script's
1 MiB chunks) and what must stay apart (other bytes, Python sources and bytecode, another Python's
directory, a symlink), and a real import that must find its bytecode still valid."""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "link-identical-files"


def env(root: Path, name: str, files: dict[str, bytes], python: str = "python3.11") -> Path:
    venv = root / name
    for relative, data in files.items():
        path = site(venv, relative, python)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return venv


def site(venv: Path, relative: str, python: str = "python3.11") -> Path:
    return venv / "lib" / python / "site-packages" / relative


def one_file(a: Path, b: Path) -> bool:
    return os.stat(a).st_ino == os.stat(b).st_ino


def run(*venvs: Path) -> str:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, venvs)], capture_output=True, text=True, check=True
    )
    return done.stdout


def test_identical_files_become_one_and_different_ones_stay_apart(tmp_path):
    big = os.urandom(3 << 20)  # over the script's 1 MiB chunk: a difference in the last chunk counts
    both = {
        "torch/lib/libtorch.so": big,
        "torch/_C.pyi": b"def f() -> None: ...\n",
        "torch/functional.py": b"def f(): pass\n",
        "torch/__pycache__/functional.cpython-311.pyc": b"bytecode",
    }
    old = env(tmp_path, ".venv", {**both, "torch/version.txt": b"1.0\n"})
    new = env(tmp_path, ".venv-base", {**both, "torch/version.txt": b"2.0\n", "only/here.so": b"x"})
    tail_differs = env(tmp_path, ".venv-tl4", {"torch/lib/libtorch.so": big[:-1] + bytes([big[-1] ^ 1])})
    printed = run(new, old)
    for same in ("torch/lib/libtorch.so", "torch/_C.pyi"):
        assert one_file(site(new, same), site(old, same)), same
    for apart in ("torch/version.txt", "torch/functional.py", "torch/__pycache__/functional.cpython-311.pyc"):
        assert not one_file(site(new, apart), site(old, apart)), apart
    assert site(new, "torch/version.txt").read_bytes() == b"2.0\n"
    assert site(new, "torch/lib/libtorch.so").read_bytes() == big
    assert "2 files shared" in printed
    run(tail_differs, old, new)
    assert not one_file(site(tail_differs, "torch/lib/libtorch.so"), site(old, "torch/lib/libtorch.so"))
    assert not list(tmp_path.rglob("*.linking"))  # no half-made link left behind


def test_a_linked_environment_keeps_its_bytecode_valid(tmp_path):
    """Through Python itself: after linking, importing a module compiles nothing again."""
    source = b"from pathlib import Path\nVALUE = Path(__file__).with_name('data.bin').read_bytes()\n"
    files = {"shared_mod.py": source, "data.bin": b"\x01\x02"}
    venvs = [env(tmp_path, name, files) for name in (".venv", ".venv-floor")]
    installed_at = (1_600_000_000, 1_700_000_000)  # each source's own modification time
    for when, venv in zip(installed_at, venvs, strict=True):
        os.utime(site(venv, "shared_mod.py"), (when, when))
        subprocess.run(
            [sys.executable, "-c", "import py_compile; py_compile.compile('shared_mod.py')"],
            cwd=site(venv, ""),
            check=True,
        )
    run(venvs[1], venvs[0])
    assert one_file(site(venvs[1], "data.bin"), site(venvs[0], "data.bin"))
    cached = next(site(venvs[1], "__pycache__").glob("shared_mod.*.pyc"))
    before = cached.stat().st_mtime_ns
    out = subprocess.run(
        [sys.executable, "-c", "import shared_mod; print(shared_mod.VALUE)"],
        cwd=site(venvs[1], ""),
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": ""},
    )
    assert out.stdout.strip() == repr(b"\x01\x02")
    assert cached.stat().st_mtime_ns == before  # its .pyc was still valid: Python did not rewrite it


def test_only_the_same_pythons_files_and_no_symlinks_are_linked(tmp_path):
    old = env(tmp_path, ".venv", {"a.so": b"same\n"}, python="python3.12")
    new = env(tmp_path, ".venv-dl", {"a.so": b"same\n", "target.so": b"same\n"})
    env(tmp_path, ".venv", {"link.so": b"same\n"})
    site(new, "link.so").symlink_to(site(new, "target.so"))
    run(new, old)
    assert not one_file(site(new, "a.so"), site(old, "a.so", python="python3.12"))
    assert site(new, "link.so").is_symlink()
