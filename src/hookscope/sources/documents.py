"""Reading documents: the text sources extraction packs, each a fixed order of strings.

Sources: a `.txt` file (one document per paragraph: blocks separated by blank lines), a `.jsonl`
file (one document per line, in `text_field`), a directory of those (sorted by path), a Hugging
Face `datasets` dataset (a directory saved with `save_to_disk`, a hub name, or a dataset object),
or `builtin:stdlib-docstrings`, a corpus built offline from Python's own docstrings.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .. import collector
from ..errors import DataError
from ..hub import offline_variable, unreachable_reason
from ..optional_imports import require

BUILTIN_STDLIB = "builtin:stdlib-docstrings"
TEXT_SUFFIXES = (".txt", ".jsonl")

# The corpus (about 1 MB) is read from the standard library's source files with `ast`, never
# imported, so nothing runs and what the host process has imported or monkeypatched (transformers
# adds methods to logging.Logger, pytest swaps sys.unraisablehook) cannot change it. A fixed list
# keeps it the same on every machine; docstrings still vary between Python versions, so a store's
# settings should record the version alongside this source.
_STDLIB_MODULES = (
    "_collections_abc _pydecimal _pyio abc argparse ast asyncio asyncio.base_events asyncio.events "
    "asyncio.futures asyncio.locks asyncio.protocols asyncio.queues asyncio.streams asyncio.subprocess "
    "asyncio.tasks asyncio.transports base64 bdb bisect bz2 calendar cmd code codecs codeop collections "
    "colorsys compileall concurrent.futures concurrent.futures._base concurrent.futures.process "
    "concurrent.futures.thread configparser contextlib copy copyreg csv dataclasses datetime dbm difflib "
    "dis doctest email.charset email.header email.headerregistry email.message email.mime.text "
    "email.parser email.policy email.utils enum filecmp fileinput fnmatch fractions ftplib functools "
    "getopt getpass gettext glob graphlib gzip hashlib heapq hmac html html.parser http.client "
    "http.cookiejar http.cookies http.server imaplib importlib importlib.metadata importlib.resources "
    "inspect io ipaddress json json.decoder json.encoder keyword linecache locale logging "
    "logging.handlers lzma mailbox mimetypes modulefinder multiprocessing.connection "
    "multiprocessing.managers multiprocessing.pool netrc numbers operator optparse os pathlib pdb pickle "
    "pkgutil platform plistlib poplib posixpath pprint profile pstats py_compile pyclbr pydoc queue "
    "quopri random re reprlib rlcompleter runpy sched secrets selectors shelve shlex shutil smtplib "
    "socket socketserver sqlite3 ssl stat statistics string subprocess symtable sysconfig tabnanny "
    "tarfile tempfile textwrap threading timeit tkinter tkinter.ttk tokenize trace traceback tracemalloc "
    "tty turtle types typing unittest unittest.case unittest.loader unittest.mock unittest.result "
    "unittest.runner unittest.suite urllib.error urllib.parse urllib.request urllib.robotparser uuid "
    "warnings wave weakref wsgiref.handlers wsgiref.simple_server xml.dom.minidom xml.etree.ElementTree "
    "xml.sax xml.sax.handler xml.sax.saxutils xmlrpc.client xmlrpc.server zipapp zipfile zipimport"
)
_STDLIB_MAX_CHARS = 3_000_000

# -- documents ------------------------------------------------------------------------------------


def iter_documents(source: Any, *, text_field: str = "text", split: str = "train") -> Iterator[str]:
    """The documents of `source`, in a fixed order; see the module docstring for what `source` can
    be. Raises DataError for a missing or unreadable source, and (when exhausted) for one with no
    documents."""
    if not isinstance(source, str | os.PathLike):
        return _nonempty(_from_hf_dataset(source, text_field, split, repr(source)), repr(source))
    name = os.fspath(source)
    if name.startswith("builtin:"):
        if name != BUILTIN_STDLIB:
            raise DataError(f"unknown built-in corpus {name!r}; the one built in is {BUILTIN_STDLIB!r}")
        return iter(stdlib_docstrings())
    if name.startswith("hf:"):
        return _nonempty(_from_hub(name.removeprefix("hf:"), text_field, split), name)
    path = Path(name).expanduser()
    if path.is_dir():
        return _nonempty(_from_dir(path, text_field, split), name)
    if path.is_file():
        return _nonempty(_from_file(path, text_field), name)
    raise missing_source(name)


def missing_source(name: str) -> DataError:
    # only hf:NAME goes to the hub: a mistyped directory must not turn into a minute of retries
    looks_like_hub = not (Path(name).suffix or Path(name).is_absolute() or name.startswith((".", "~")))
    hub = f", or hf:{name} if you meant a Hugging Face hub dataset" if looks_like_hub else ""
    return DataError(
        f"data source {name!r}: no such file or directory; give a .txt / .jsonl file, a "
        f"directory of them or one saved with save_to_disk, or {BUILTIN_STDLIB}{hub}"
    )


def _nonempty(docs: Iterator[str], name: str) -> Iterator[str]:
    count = 0
    for doc in docs:
        count += 1
        yield doc
    if not count:
        raise DataError(f"data source {name!r} holds no documents; point --data at some text")


def _from_file(path: Path, text_field: str) -> Iterator[str]:
    if path.suffix == ".txt":
        return _from_txt(path)
    if path.suffix == ".jsonl":
        return _from_jsonl(path, text_field)
    raise DataError(f"{path}: unsupported file type {path.suffix!r}; use .txt (paragraphs) or .jsonl")


def _from_txt(path: Path) -> Iterator[str]:
    paragraph: list[str] = []
    for line in _lines(path):
        if line.strip():
            paragraph.append(line.rstrip("\r\n"))
        elif paragraph:
            yield "\n".join(paragraph).strip()
            paragraph = []
    if paragraph:
        yield "\n".join(paragraph).strip()


def _from_jsonl(path: Path, text_field: str) -> Iterator[str]:
    for number, line in enumerate(_lines(path), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict) or text_field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(
                f"{path}:{number}: no {text_field!r} field (found {keys}); choose it with --text-field"
            )
        if not isinstance(record[text_field], str):
            raise DataError(
                f"{path}:{number}: {text_field!r} is {type(record[text_field]).__name__}, not text"
            )
        yield record[text_field]


def _lines(path: Path) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as f:
            yield from f
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason}); convert it to UTF-8") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror})") from None


def _from_dir(path: Path, text_field: str, split: str) -> Iterator[str]:
    if is_saved_dataset(path):
        datasets = _import_datasets()
        try:
            loaded = datasets.load_from_disk(str(path))
        except Exception as e:  # datasets raises several unrelated types for a damaged directory
            raise DataError(f"{path}: cannot load it as a saved Hugging Face dataset ({e})") from e
        yield from _from_hf_dataset(loaded, text_field, split, str(path))
        return
    files = text_files(path)
    if not files:
        raise DataError(f"{path}: no .txt or .jsonl files in this directory")
    for file in files:
        yield from _from_file(file, text_field)


def text_files(path: Path) -> list[Path]:
    """The .txt / .jsonl files under `path`, in the order they are read."""
    return sorted(
        (p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()),
        key=lambda p: p.relative_to(path).as_posix(),
    )


def is_saved_dataset(path: Path) -> bool:
    """Whether `path` is a directory written by `datasets`' save_to_disk (a dataset or a dict of them)."""
    return (path / "dataset_dict.json").exists() or (path / "state.json").exists()


def _from_hub(name: str, text_field: str, split: str) -> Iterator[str]:
    datasets = _import_datasets()
    repo, _, config = name.partition(":")  # "owner/name:config"
    if not repo:
        raise DataError("--data hf: needs a dataset name, e.g. hf:owner/name or hf:owner/name:config")
    reason = unreachable_reason()
    if reason is not None and offline_variable() is None:  # with an offline variable, try the cache
        raise DataError(
            f"data source 'hf:{name}': the Hugging Face hub cannot be reached ({reason}). "
            "Save the dataset with `datasets`' save_to_disk on a connected machine and give "
            "that directory, or a .txt / .jsonl file; HF_DATASETS_OFFLINE=1 reads a copy "
            "already in the datasets cache"
        )
    try:  # streaming: read only as far as the token budget needs, in the dataset's own order
        loaded = datasets.load_dataset(repo, config or None, split=split, streaming=True)
    except Exception as e:  # network, missing repo, missing split...: all one answer for the user
        raise DataError(
            f"data source 'hf:{name}': loading it from the Hugging Face hub failed "
            f"({type(e).__name__}: {e}). Check the name (hf:owner/name[:config]) and "
            "--text-field, or give a local file or directory"
        ) from e
    yield from _from_hf_dataset(loaded, text_field, split, name)


def _from_hf_dataset(ds: Any, text_field: str, split: str, name: str) -> Iterator[str]:
    if isinstance(ds, dict):  # a DatasetDict: pick the split
        if split not in ds:
            raise DataError(f"{name}: no split {split!r}; it has {sorted(ds)}")
        ds = ds[split]
    columns = getattr(ds, "column_names", None)
    if columns is not None and text_field not in columns:
        raise DataError(f"{name}: no column {text_field!r} (columns: {columns}); choose it with --text-field")
    for number, row in enumerate(ds):
        text = row.get(text_field) if isinstance(row, dict) else None
        if not isinstance(text, str):
            raise DataError(f"{name}: row {number} has no text in {text_field!r}")
        yield text


def _import_datasets() -> Any:
    return require("datasets", extra="datasets", needed_for="this data source", error=DataError)


@functools.lru_cache(maxsize=1)
def stdlib_docstrings() -> tuple[str, ...]:
    """Docstrings of the modules in _STDLIB_MODULES and of their public classes, functions and
    methods, in source order, stopping after the module that passes _STDLIB_MAX_CHARS."""
    root = Path(sysconfig.get_path("stdlib"))
    docs: list[str] = []
    total = 0
    # syntax trees hold no cycles; with torch loaded, collections would triple the time
    with collector.paused():
        for name in _STDLIB_MODULES.split():
            base = root.joinpath(*name.split("."))
            path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
            if not path.is_file():  # a trimmed-down Python (some distributions split packages out)
                continue
            for doc in _docstrings_in(ast.parse(path.read_bytes(), filename=str(path))):
                docs.append(doc)
                total += len(doc)
            if total >= _STDLIB_MAX_CHARS:
                break
    if not docs:
        raise DataError(f"no standard library sources under {root}; use --data with your own text")
    return tuple(docs)


def _docstrings_in(tree: ast.Module) -> Iterator[str]:
    """The module's docstring, then each public top-level class (and its public methods) and function."""
    nodes: list[ast.AST] = [tree]
    for node in tree.body:
        if isinstance(
            node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
        ) and not node.name.startswith("_"):
            nodes.append(node)
            if isinstance(node, ast.ClassDef):
                nodes += [
                    m
                    for m in node.body
                    if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef) and not m.name.startswith("_")
                ]
    for node in nodes:
        doc = ast.get_docstring(node)
        if doc and doc.strip():
            yield doc.strip()
