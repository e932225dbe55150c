"""Where a top-k index is kept, and reading it back.

An index is kept beside its store, at the store's own location (`STORE/top/<point>.<neurons|
sae-SHA>.safetensors`: a directory or a URL, written with the store filesystem's atomic put), so
whoever reads the store finds it. When the store cannot be written (a read-only directory, a bucket
without write access), or when `cache_dir` is given, it goes to a local cache instead:
`cache_dir`, else `$HOOKSCOPE_CACHE/top`, else `~/.cache/hookscope/top`, in a folder named after
the store's contents (settings hash and shard list), so an index there only ever serves the store
it was built from.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError
from safetensors.torch import load

from ..errors import StaleIndexError, StoreError
from ..store.fs import FS, LocalFS, open_fs
from .encoders import Encoder, neurons
from .index import (
    DEFAULT_INDEX_K,
    INDEX_DIR,
    INDEX_FORMAT,
    INDEX_VERSION,
    TopIndex,
    build_index,
    check_point,
    store_key,
)

if TYPE_CHECKING:  # the store room is below this one; a Store is passed in
    from ..store import Store

Place = tuple[FS, str]  # a filesystem and the index's name in it


def default_cache_dir() -> Path:
    """Where the indexes of stores that cannot be written go: $HOOKSCOPE_CACHE/top, or
    ~/.cache/hookscope/top."""
    root = os.environ.get("HOOKSCOPE_CACHE")
    return Path(root) / "top" if root else Path.home() / ".cache" / "hookscope" / "top"


def _name(point: str, encoder: Encoder) -> str:
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', point)}.{encoder.identity}.safetensors"


def _cached(store: Store, point: str, encoder: Encoder, cache_dir: str | os.PathLike | None) -> Place:
    key = hashlib.sha256(json.dumps(store_key(store), sort_keys=True).encode()).hexdigest()[:16]
    return LocalFS(
        Path(cache_dir) if cache_dir is not None else default_cache_dir()
    ), f"{key}/{_name(point, encoder)}"


def _places(store: Store, point: str, encoder: Encoder, cache_dir: str | os.PathLike | None) -> list[Place]:
    """Where the index is looked for, in order: `cache_dir` alone when given; else beside the
    store, then the default cache."""
    if cache_dir is not None:
        return [_cached(store, point, encoder, cache_dir)]
    return [(store.fs, f"{INDEX_DIR}/{_name(point, encoder)}"), _cached(store, point, encoder, None)]


def index_path(store: Store, point: str, encoder: Encoder, cache_dir: str | os.PathLike | None = None) -> str:
    """Where the index of `point` (and `encoder`) is kept first: beside the store (a path or a URL),
    or in `cache_dir`."""
    fs, rel = _places(store, point, encoder, cache_dir)[0]
    return fs.where(rel)


def load_index(store: Store, point: str, encoder: Encoder, path: str | os.PathLike | None = None) -> TopIndex:
    """The saved index of `point` (and `encoder`) at `path` (default: beside the store), checked
    against the store as it is now. FileNotFoundError if there is none."""
    if path is None:
        return _load(store, point, encoder, *_places(store, point, encoder, None)[0])
    location = os.fspath(path)
    parent, _, name = location.rstrip("/").rpartition("/")
    return _load(store, point, encoder, open_fs(parent or "."), name)


def _load(store: Store, point: str, encoder: Encoder, fs: FS, rel: str) -> TopIndex:
    where = fs.where(rel)
    data = fs.read(rel)
    try:
        tensors = load(data)
        meta = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")]).get("__metadata__") or {}
        info = json.loads(meta[INDEX_FORMAT])
    except (KeyError, ValueError, AttributeError) as e:
        raise StoreError(f"{where}: not a hookscope top-k index (no {INDEX_FORMAT!r} metadata)") from e
    except (SafetensorError, RuntimeError) as e:
        raise StoreError(f"{where}: not a readable top-k index ({e}); delete it and build it again") from e
    if info.get("version") != INDEX_VERSION:
        raise StaleIndexError(
            f"{where}: index format version {info.get('version')}, this hookscope reads "
            f"{INDEX_VERSION}; rebuild it (hookscope top ... --rebuild)"
        )
    _check_fresh(where, info, store, point, encoder)
    values = tensors.get("values")
    if (
        any(k not in tensors for k in ("rows", "hist", "fires"))
        or values is None
        or values.shape[0] != info.get("units")
        or tensors["rows"].shape != values.shape
    ):
        raise StoreError(f"{where}: index tensors do not match its metadata: the file is damaged; rebuild it")
    return TopIndex(tensors["values"], tensors["rows"], tensors["hist"], tensors["fires"], info)


def _check_fresh(where: str, info: dict, store: Store, point: str, encoder: Encoder) -> None:
    now = store_key(store)
    problems = []
    if info.get("settings_hash") != now["settings_hash"]:
        problems.append("the store's settings_hash differs")
    if info.get("shards") != now["shards"]:
        old, new = {tuple(s) for s in info.get("shards", [])}, {tuple(s) for s in now["shards"]}
        problems.append(
            f"the shard list differs ({len(new - old)} shard(s) added or changed, "
            f"{len(old - new)} gone; {len(now['shards'])} now, "
            f"{len(info.get('shards', []))} then)"
        )
    if info.get("point") != point or info.get("source") != encoder.source:
        problems.append("it was built for another point or SAE")
    if problems:
        raise StaleIndexError(
            f"{where}: this top-k index no longer matches the store: "
            f"{'; '.join(problems)}. Rebuild it (hookscope top ... --rebuild, or "
            "build_index + save)"
        )


def get_index(
    store: Store,
    point: str,
    *,
    encoder: Encoder | None = None,
    k: int = DEFAULT_INDEX_K,
    rebuild: bool = False,
    progress: bool = False,
    save: bool = True,
    cache_dir: str | os.PathLike | None = None,
) -> TopIndex:
    """The saved index if there is one and it matches (and keeps at least k per unit); otherwise
    build it and save it (beside the store, else in the cache: see this module). A stale index is
    refused unless `rebuild`."""
    encoder = encoder or neurons(check_point(store, point))
    places = _places(store, point, encoder, cache_dir)
    for fs, rel in places if not rebuild else []:
        if fs.size(rel) is None:
            continue
        index = _load(store, point, encoder, fs, rel)
        if index.k >= min(k, len(store)):
            return index
        raise StoreError(
            f"{fs.where(rel)}: the saved index keeps {index.k} rows per unit, {k} asked; "
            f"rebuild it with k >= {k} (hookscope top ... --rebuild --k {k})"
        )
    index = build_index(store, point, encoder=encoder, k=k, progress=progress)
    if save:
        _save(index, places)
    return index


def _save(index: TopIndex, places: list[Place]) -> None:
    """Into the first place that takes it (the store read-only: the cache)."""
    data, failed = index.to_bytes(), []
    for fs, rel in places:
        try:
            fs.makedirs(rel.rpartition("/")[0])
            fs.put(rel, data, durable=False)
            return
        except (OSError, StoreError) as e:
            failed.append(f"{fs.where(rel)} ({e})")
    raise StoreError(
        f"cannot save the top-k index: {'; '.join(failed)}; make the store directory or the "
        "cache (cache_dir=, $HOOKSCOPE_CACHE) writable"
    )
