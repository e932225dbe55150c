"""What a text source is, for a store's settings and a progress bar: its fingerprint (so that
resuming on changed data is refused) and how much of it has been read."""

from __future__ import annotations

import collections
import hashlib
import os
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ..errors import DataError
from .documents import (
    BUILTIN_STDLIB,
    TEXT_SUFFIXES,
    is_saved_dataset,
    missing_source,
    stdlib_docstrings,
    text_files,
)
from .tokenize import TOKENIZE_BATCH


def source_fingerprint(source: Any, *, text_field: str = "text", split: str = "train") -> dict[str, Any]:
    """What a store's settings record about its data, so that resuming on changed data is refused.

    Files are hashed in full (SHA-256 of the bytes, streamed in 1 MiB reads): size and mtime alone
    miss an edit that keeps the size, and a copy that keeps the contents is still the same data.
    A directory records one hash per file it reads (every file, for a `save_to_disk` directory),
    so a refusal names the file that changed. A `datasets` object records its own fingerprint;
    `hf:NAME` records the name and split only (the hub's copy is not hashed: pin a saved copy with
    `save_to_disk` for a guarantee); the built-in corpus records the Python version it comes from.
    """
    if not isinstance(source, str | os.PathLike):
        fingerprint = getattr(source, "_fingerprint", None)
        if fingerprint is None and isinstance(source, dict):  # a DatasetDict: its split's
            fingerprint = getattr(source.get(split), "_fingerprint", None)
        if fingerprint is None:
            raise DataError(
                f"cannot fingerprint a data source of type {type(source).__name__}; pass a "
                "file, a directory or a Hugging Face dataset"
            )
        return {"kind": "datasets", "fingerprint": fingerprint, "split": split}
    name = os.fspath(source)
    if name.startswith("builtin:"):
        return {"kind": "builtin", "name": name, "python": list(sys.version_info[:2])}
    if name.startswith("hf:"):
        return {"kind": "hub", "name": name.removeprefix("hf:"), "split": split}
    path = Path(name).expanduser()
    if path.is_file():
        return {"kind": "file", **_file_fingerprint(path)}
    if path.is_dir():
        saved = is_saved_dataset(path)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if saved else text_files(path)
        return {
            "kind": "saved dataset" if saved else "directory",
            "files": {f.relative_to(path).as_posix(): _file_fingerprint(f)["sha256"] for f in files},
        }
    raise missing_source(name)


def _file_fingerprint(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    size = 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
                size += len(chunk)
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror})") from None
    return {"bytes": size, "sha256": digest.hexdigest()}


class ReadMeter:
    """Passes documents through, counting their characters, so a progress bar can tell how much of
    the source has been packed (`fraction`) when the source's size is known (`source_chars`)."""

    def __init__(self, documents: Iterable[str], total_chars: int | None, workers: int = 0):
        self._documents, self.total_chars = documents, total_chars
        self.chars = self.count = 0
        # characters read up to and including each of the last documents: the tokenizer reads
        # ahead of packing by a chunk of TOKENIZE_BATCH documents, two per worker process, so
        # progress is asked by document
        self._recent: collections.deque[int] = collections.deque(maxlen=(4 + 2 * workers) * TOKENIZE_BATCH)

    def __iter__(self) -> Iterator[str]:
        for doc in self._documents:
            self.chars += len(doc)
            self.count += 1
            self._recent.append(self.chars)
            yield doc

    def fraction(self, through_doc: int | None = None) -> float | None:
        """The share of the source's characters in documents 0..through_doc (default: all read)."""
        if not self.total_chars or not self.chars:
            return None
        chars = self.chars
        first_recent = self.count - len(self._recent)
        if through_doc is not None and first_recent <= through_doc < self.count:
            chars = self._recent[through_doc - first_recent]
        return min(1.0, chars / self.total_chars)


def source_chars(source: Any) -> int | None:
    """About how many characters of text `source` holds: exact for the built-in corpus, the bytes of
    the files for a file or directory (a little more than their text), None when unknown."""
    if not isinstance(source, str | os.PathLike):
        return None
    name = os.fspath(source)
    if name == BUILTIN_STDLIB:
        return sum(map(len, stdlib_docstrings()))
    path = Path(name).expanduser()
    if path.is_file() and path.suffix in TEXT_SUFFIXES:
        return path.stat().st_size
    if path.is_dir() and not is_saved_dataset(path):
        return sum(p.stat().st_size for p in text_files(path)) or None
    return None
