"""Text sources -> packed, fixed-length token sequences that remember where every token came from.

Sources: a `.txt` file (one document per paragraph: blocks separated by blank lines), a `.jsonl`
file (one document per line, in `text_field`), a directory of those (sorted by path), a Hugging
Face `datasets` dataset (a directory saved with `save_to_disk`, a hub name, or a dataset object),
or `builtin:stdlib-docstrings`, a corpus built offline from Python's own docstrings.

Packing (see `pack_policy`): the documents' tokens, with a separator token between documents,
form one stream; each sequence is a start token (BOS, or [CLS] for BERT-like tokenizers) followed
by the next `context - 1` tokens of the stream. Every token carries its document index and its
index in that document's tokenization (-1 for start, separator and padding tokens).
"""

from __future__ import annotations

import ast
import collections
import functools
import gc
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import DataError
from .hub import offline_variable, unreachable_reason

BUILTIN_STDLIB = "builtin:stdlib-docstrings"
_TEXT_SUFFIXES = (".txt", ".jsonl")
_TOKENIZE_BATCH = 64  # documents per tokenizer call: fast tokenizers work in parallel over a list

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
        return iter(_stdlib_docstrings())
    if name.startswith("hf:"):
        return _nonempty(_from_hub(name.removeprefix("hf:"), text_field, split), name)
    path = Path(name).expanduser()
    if path.is_dir():
        return _nonempty(_from_dir(path, text_field, split), name)
    if path.is_file():
        return _nonempty(_from_file(path, text_field), name)
    raise _missing(name)


def _missing(name: str) -> DataError:
    # only hf:NAME goes to the hub: a mistyped directory must not turn into a minute of retries
    looks_like_hub = not (Path(name).suffix or Path(name).is_absolute() or name.startswith((".", "~")))
    hub = f", or hf:{name} if you meant a Hugging Face hub dataset" if looks_like_hub else ""
    return DataError(f"data source {name!r}: no such file or directory; give a .txt / .jsonl file, a "
                     f"directory of them or one saved with save_to_disk, or {BUILTIN_STDLIB}{hub}")


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
            raise DataError(f"{path}:{number}: no {text_field!r} field (found {keys}); "
                            "choose it with --text-field")
        if not isinstance(record[text_field], str):
            raise DataError(f"{path}:{number}: {text_field!r} is "
                            f"{type(record[text_field]).__name__}, not text")
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
    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():  # written by save_to_disk
        datasets = _import_datasets()
        try:
            loaded = datasets.load_from_disk(str(path))
        except Exception as e:  # datasets raises several unrelated types for a damaged directory
            raise DataError(f"{path}: cannot load it as a saved Hugging Face dataset ({e})") from e
        yield from _from_hf_dataset(loaded, text_field, split, str(path))
        return
    files = _text_files(path)
    if not files:
        raise DataError(f"{path}: no .txt or .jsonl files in this directory")
    for file in files:
        yield from _from_file(file, text_field)


def _text_files(path: Path) -> list[Path]:
    """The .txt / .jsonl files under `path`, in the order they are read."""
    return sorted((p for p in path.rglob("*") if p.suffix in _TEXT_SUFFIXES and p.is_file()),
                  key=lambda p: p.relative_to(path).as_posix())


def _from_hub(name: str, text_field: str, split: str) -> Iterator[str]:
    datasets = _import_datasets()
    repo, _, config = name.partition(":")  # "owner/name:config"
    if not repo:
        raise DataError("--data hf: needs a dataset name, e.g. hf:owner/name or hf:owner/name:config")
    reason = unreachable_reason()
    if reason is not None and offline_variable() is None:  # with an offline variable, try the cache
        raise DataError(f"data source 'hf:{name}': the Hugging Face hub cannot be reached ({reason}). "
                        "Save the dataset with `datasets`' save_to_disk on a connected machine and give "
                        "that directory, or a .txt / .jsonl file; HF_DATASETS_OFFLINE=1 reads a copy "
                        "already in the datasets cache")
    try:  # streaming: read only as far as the token budget needs, in the dataset's own order
        loaded = datasets.load_dataset(repo, config or None, split=split, streaming=True)
    except Exception as e:  # network, missing repo, missing split...: all one answer for the user
        raise DataError(f"data source 'hf:{name}': loading it from the Hugging Face hub failed "
                        f"({type(e).__name__}: {e}). Check the name (hf:owner/name[:config]) and "
                        "--text-field, or give a local file or directory") from e
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
    try:
        import datasets
    except ImportError as e:
        raise DataError("this data source needs the `datasets` package: "
                        "pip install 'hookscope[datasets]'") from e
    return datasets


@functools.lru_cache(maxsize=1)
def _stdlib_docstrings() -> tuple[str, ...]:
    """Docstrings of the modules in _STDLIB_MODULES and of their public classes, functions and
    methods, in source order, stopping after the module that passes _STDLIB_MAX_CHARS."""
    root = Path(sysconfig.get_path("stdlib"))
    docs: list[str] = []
    total = 0
    collecting = gc.isenabled()
    gc.disable()  # syntax trees hold no cycles; with torch loaded, collections would triple the time
    try:
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
    finally:
        if collecting:
            gc.enable()
    if not docs:
        raise DataError(f"no standard library sources under {root}; use --data with your own text")
    return tuple(docs)


def _docstrings_in(tree: ast.Module) -> Iterator[str]:
    """The module's docstring, then each public top-level class (and its public methods) and function."""
    nodes: list[ast.AST] = [tree]
    for node in tree.body:
        if (isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                and not node.name.startswith("_")):
            nodes.append(node)
            if isinstance(node, ast.ClassDef):
                nodes += [m for m in node.body if isinstance(m, ast.FunctionDef | ast.AsyncFunctionDef)
                          and not m.name.startswith("_")]
    for node in nodes:
        doc = ast.get_docstring(node)
        if doc and doc.strip():
            yield doc.strip()


# -- fingerprints ---------------------------------------------------------------------------------


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
            raise DataError(f"cannot fingerprint a data source of type {type(source).__name__}; pass a "
                            "file, a directory or a Hugging Face dataset")
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
        saved = (path / "dataset_dict.json").exists() or (path / "state.json").exists()
        files = (sorted(p for p in path.rglob("*") if p.is_file()) if saved else _text_files(path))
        return {"kind": "saved dataset" if saved else "directory",
                "files": {f.relative_to(path).as_posix(): _file_fingerprint(f)["sha256"] for f in files}}
    raise _missing(name)


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

    def __init__(self, documents: Iterable[str], total_chars: int | None):
        self._documents, self.total_chars = documents, total_chars
        self.chars = self.count = 0
        # characters read up to and including each of the last documents: the tokenizer reads
        # ahead of packing by up to _TOKENIZE_BATCH documents, so progress is asked by document
        self._recent: collections.deque[int] = collections.deque(maxlen=4 * _TOKENIZE_BATCH)

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
        return sum(map(len, _stdlib_docstrings()))
    path = Path(name).expanduser()
    if path.is_file() and path.suffix in _TEXT_SUFFIXES:
        return path.stat().st_size
    if path.is_dir() and not ((path / "dataset_dict.json").exists() or (path / "state.json").exists()):
        return sum(p.stat().st_size for p in _text_files(path)) or None
    return None


# -- packing --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackPolicy:
    """Which special tokens packing inserts; `as_dict()` belongs in a store's settings."""

    start_id: int | None  # opens every sequence: BOS, or [CLS] for BERT-like tokenizers
    separator_id: int | None  # between documents: EOS, else [SEP], else BOS
    pad_id: int  # fills the last, partial sequence when drop_remainder=False
    start_token: str | None
    separator_token: str | None

    def as_dict(self) -> dict[str, Any]:
        return {"start": self.start_token, "separator": self.separator_token,
                "rule": "start token opens every sequence; separator between documents"}


def pack_policy(tokenizer: Any, bos: str | bool = "auto") -> PackPolicy:
    """`bos="auto"` uses the tokenizer's BOS (or CLS) token if it has one, `True` requires one,
    `False` starts sequences without one (documents are still separated)."""
    if bos not in ("auto", True, False):
        raise DataError(f"bos={bos!r}: use 'auto', True or False")
    start = _first_id(tokenizer, "bos_token_id", "cls_token_id")
    if bos is True and start is None:
        raise DataError(f"{type(tokenizer).__name__} has neither a BOS nor a CLS token; "
                        "use bos='auto' or False")
    start = start if bos else None
    separator = _first_id(tokenizer, "eos_token_id", "sep_token_id", "bos_token_id")
    pad = _first_id(tokenizer, "pad_token_id", "eos_token_id")

    def name(i: int | None) -> str | None:
        return None if i is None else tokenizer.convert_ids_to_tokens(i)

    return PackPolicy(start, separator, 0 if pad is None else pad, name(start), name(separator))


def _first_id(tokenizer: Any, *attributes: str) -> int | None:
    for attribute in attributes:
        value = getattr(tokenizer, attribute, None)
        if isinstance(value, int):
            return value
    return None


@dataclass(frozen=True)
class PackedSequence:
    """One sequence of `context` tokens. doc_ids / doc_positions are -1 on special and padding tokens."""

    seq_id: int
    input_ids: torch.Tensor  # [T] int64
    attention_mask: torch.Tensor  # [T] int64, 0 on padding
    doc_ids: torch.Tensor  # [T] int64: index of the token's document in the source's order
    doc_positions: torch.Tensor  # [T] int64: index of the token in its document's own tokenization
    special_mask: torch.Tensor  # [T] bool: start and separator tokens


def pack(documents: Iterable[str], tokenizer: Any, context: int = 128, *, bos: str | bool = "auto",
         drop_remainder: bool = True, max_tokens: int | None = None) -> Iterator[PackedSequence]:
    """Tokenize `documents` (without the tokenizer's own special tokens) and pack them into
    sequences of `context` tokens (see the module docstring). `max_tokens` caps the tokens emitted;
    the last partial sequence is dropped unless `drop_remainder=False`, which pads it."""
    policy = pack_policy(tokenizer, bos)
    body = context - (policy.start_id is not None)
    if body < 1:
        raise DataError(f"context {context} leaves no room for text after the start token")
    if max_tokens is not None and max_tokens < 1:
        raise DataError(f"max_tokens={max_tokens} must be >= 1")
    return _pack(documents, tokenizer, policy, context, body, drop_remainder, max_tokens)


def _pack(documents: Iterable[str], tokenizer: Any, policy: PackPolicy, context: int, body: int,
          drop_remainder: bool, max_tokens: int | None) -> Iterator[PackedSequence]:
    budget = max_tokens if max_tokens is not None else sys.maxsize
    lead = context - body
    ids: list[int] = []  # the stream of body tokens not yet emitted, with their origins
    docs: list[int] = []
    positions: list[int] = []
    seq_id = seen = 0
    for doc_id, tokens in _tokenized(documents, tokenizer):
        if not tokens:
            continue
        if seen and policy.separator_id is not None:
            ids.append(policy.separator_id)
            docs.append(-1)
            positions.append(-1)
        seen += len(tokens)
        ids += tokens
        docs += [doc_id] * len(tokens)
        positions += range(len(tokens))
        at = 0
        while len(ids) - at >= body and budget >= context:
            yield _sequence(seq_id, policy, context, ids[at : at + body], docs[at : at + body],
                            positions[at : at + body])
            seq_id, at, budget = seq_id + 1, at + body, budget - context
        del ids[:at], docs[:at], positions[:at]
        if budget < context and (drop_remainder or len(ids) >= budget - lead):
            break  # the budget is spent: read no further documents
    rest = min(len(ids), budget - lead)
    if not drop_remainder and rest > 0:
        yield _sequence(seq_id, policy, context, ids[:rest], docs[:rest], positions[:rest])
        seq_id += 1
    if not seq_id:
        raise DataError(f"the data gave {seen} tokens, not enough for one sequence of {context}"
                        + (f" within max_tokens={max_tokens}" if max_tokens is not None else "")
                        + "; add data, lower --context, or keep the remainder (drop_remainder=False)")


def _tokenized(documents: Iterable[str], tokenizer: Any) -> Iterator[tuple[int, list[int]]]:
    doc_id = 0
    for chunk in _chunks(documents):
        out = tokenizer(chunk, add_special_tokens=False, verbose=False, return_attention_mask=False,
                        return_token_type_ids=False)["input_ids"]
        for tokens in out:
            yield doc_id, tokens
            doc_id += 1


def _chunks(documents: Iterable[str]) -> Iterator[list[str]]:
    chunk: list[str] = []
    for doc in documents:
        if not isinstance(doc, str):
            raise DataError(f"documents must be strings, got {type(doc).__name__}")
        chunk.append(doc)
        if len(chunk) == _TOKENIZE_BATCH:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _sequence(seq_id: int, policy: PackPolicy, context: int, ids: list[int], docs: list[int],
              positions: list[int]) -> PackedSequence:
    lead = 0 if policy.start_id is None else 1
    pad = context - lead - len(ids)
    return PackedSequence(
        seq_id,
        input_ids=torch.tensor([policy.start_id] * lead + ids + [policy.pad_id] * pad),
        attention_mask=torch.tensor([1] * (context - pad) + [0] * pad),
        doc_ids=torch.tensor([-1] * lead + docs + [-1] * pad),
        doc_positions=torch.tensor([-1] * lead + positions + [-1] * pad),
        special_mask=torch.tensor([True] * lead + [d == -1 for d in docs] + [False] * pad),
    )


def batches(sequences: Iterable[PackedSequence], batch_size: int, *,
            drop_last: bool = False) -> Iterator[dict[str, torch.Tensor]]:
    """Stack sequences into batches: input_ids, attention_mask, doc_ids, doc_positions,
    special_mask [B, T] and seq_ids [B]."""
    if batch_size < 1:
        raise DataError(f"batch_size={batch_size} must be >= 1")
    group: list[PackedSequence] = []
    for seq in sequences:
        group.append(seq)
        if len(group) == batch_size:
            yield _stack(group)
            group = []
    if group and not drop_last:
        yield _stack(group)


def _stack(group: list[PackedSequence]) -> dict[str, torch.Tensor]:
    out = {k: torch.stack([getattr(s, k) for s in group])
           for k in ("input_ids", "attention_mask", "doc_ids", "doc_positions", "special_mask")}
    out["seq_ids"] = torch.tensor([s.seq_id for s in group])
    return out
