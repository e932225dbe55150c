"""What needs more than the base install says which extra to install: every `hookscope[X]` a message
or a page names is an extra pyproject.toml declares, and each path that needs one stops on a
HookscopeError naming it (never a ModuleNotFoundError from deep inside) when its package is missing.
The packages are made missing by a `None` in sys.modules, which makes their import fail."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import pytest
from sparse_store import make_sparse_store

import hookscope as hs
from hookscope.errors import HookscopeError
from hookscope.export import export_hf
from hookscope.export.hf import to_hf_dataset
from hookscope.sources import iter_documents
from hookscope.store.fs import _EXTRAS

ROOT = Path(__file__).resolve().parents[2]
NAMED = re.compile(r"hookscope\[([a-z0-9_-]+)\]")


def declared_extras() -> set[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return set(tomllib.load(f)["project"]["optional-dependencies"])


def test_every_extra_a_message_or_page_names_exists():
    named = {}
    for folder in ("src", "docs", "examples", "README.md"):
        files = [ROOT / folder] if folder.endswith(".md") else (ROOT / folder).rglob("*.*")
        for path in files:
            if path.suffix in {".py", ".md"}:
                for extra in NAMED.findall(path.read_text(encoding="utf-8")):
                    named.setdefault(extra, path.relative_to(ROOT))
    assert {"datasets", "s3", "plot"} <= named.keys()  # the scan sees the messages below
    named.update({extra: "hookscope.store.fs (a URL scheme's extra)" for extra in _EXTRAS.values()})
    unknown = {extra: str(path) for extra, path in named.items() if extra not in declared_extras()}
    assert not unknown, f"these name an extra pyproject.toml does not declare: {unknown}"


def without(monkeypatch, *modules: str) -> None:
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def test_a_saved_dataset_without_datasets_names_the_extra(tmp_path, monkeypatch):
    (tmp_path / "state.json").write_text("{}")  # what save_to_disk leaves
    without(monkeypatch, "datasets")
    with pytest.raises(HookscopeError, match=re.escape("pip install 'hookscope[datasets]'")):
        next(iter_documents(tmp_path))
    with pytest.raises(HookscopeError, match=re.escape("pip install 'hookscope[datasets]'")):
        next(iter_documents("hf:owner/name"))


def test_exporting_without_datasets_names_the_extra(tmp_path, monkeypatch):
    store = make_sparse_store(tmp_path / "store", rows=64)
    without(monkeypatch, "datasets", "pyarrow")
    with pytest.raises(HookscopeError, match=re.escape("pip install 'hookscope[datasets]'")):
        to_hf_dataset(store)
    with pytest.raises(HookscopeError, match=re.escape("pip install 'hookscope[datasets]'")):
        export_hf(store, tmp_path / "hf")


def test_an_s3_url_without_s3fs_names_the_extra(monkeypatch):
    without(monkeypatch, "s3fs")
    with pytest.raises(HookscopeError, match=re.escape("pip install 'hookscope[s3]'")):
        hs.open_store("s3://bucket/acts")
