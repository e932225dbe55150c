"""The store's manifest: what a directory of shards holds, and the settings that made it.

The manifest is the single source of truth: a shard file not listed in it does not exist as far as
readers and resuming writers are concerned. It is replaced atomically (store/fs.py's put: tmp +
fsync + rename, or one PUT), so a crash leaves either the old or the new manifest, never a mix.
Every shard entry is self-contained (its batch indices, the attempt and rank that wrote it, its
statistics), so the manifests of several ranks and attempts merge by taking the union of their
entries. See docs/store-format.md for the format on one page.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import collector
from ..errors import StoreError
from .entry import (  # noqa: F401 - the store's modules import the entry's names from here
    IDENTITY,
    SHARDS_DIR,
    Runs,
    ShardEntry,
    check_fits,
    expect,
    nonnegative,
    runs_of,
    shard_from_json,
    shard_identity,
    shard_v1_from_json,
    stats_from_json,
)
from .stats import PointStats

FORMAT = "hookscope-store"
VERSION = 2  # 2: shards list their batches explicitly and carry their own stats (elastic resume)
MANIFEST = "manifest.json"


def manifest_name(rank: int, world_size: int, generation: int = 0) -> str:
    """`manifest.json` for a single process; `manifest.rank{r}.json` per rank under torchrun, and
    `manifest.rank{r}.gen{g}.json` for the ranks of a later attempt with another world size."""
    if world_size == 1:
        return MANIFEST
    return f"manifest.rank{rank}.json" if generation == 0 else f"manifest.rank{rank}.gen{generation}.json"


def shard_prefix(rank: int, generation: int = 0) -> str:
    """The start of every shard file name of `rank` in attempt `generation` (0: as in version 1)."""
    return f"shard-r{rank:03d}-" if generation == 0 else f"shard-g{generation:03d}-r{rank:03d}-"


def shard_number(file: str) -> int:
    """The running number a shard file's name ends with (-1 for a name without one)."""
    m = re.search(r"-(\d+)\.safetensors$", file)
    return int(m.group(1)) if m else -1


def canonical_json(value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise StoreError(
            f"store settings must be plain JSON (str, int, float, bool, None, list, dict): {e}"
        ) from e


def settings_hash(settings: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of `settings` (key order and tuples-vs-lists do not matter)."""
    return hashlib.sha256(canonical_json(settings).encode()).hexdigest()


def settings_diff(stored: dict[str, Any], given: dict[str, Any]) -> list[str]:
    """One line per top-level key whose value differs, e.g. `context: stored 128, given 256`."""
    given = json.loads(canonical_json(given))  # compare as they would be stored (tuples -> lists)
    lines = []
    for key in sorted(set(stored) | set(given)):
        a, b = stored.get(key, _ABSENT), given.get(key, _ABSENT)
        if isinstance(a, dict) and isinstance(b, dict):  # name the inner key that changed (a data file)
            lines += [f"{key}.{line}" for line in settings_diff(a, b)]
        elif a != b:
            lines.append(f"{key}: stored {_show(a)}, given {_show(b)}")
    return lines


_ABSENT = object()


def _show(value: Any) -> str:
    return "(absent)" if value is _ABSENT else json.dumps(value)


@dataclass(frozen=True)
class Column:
    """One named tensor per shard: `shape` is the per-row shape (the rows dimension left out)."""

    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of this column in a shard."""
        return math.prod(self.shape) * getattr(torch, self.dtype).itemsize


_SHARDS = "hookscope: the shard entries go here"


def summed_stats(shards: list[ShardEntry]) -> dict[str, PointStats]:
    """Per-point statistics of `shards`, added in list order (the order fixes the float sums)."""
    total: dict[str, PointStats] = {}
    for s in shards:
        for name, st in (s.stats or {}).items():
            total[name] = total.get(name, PointStats()).merge(st)
    return total


@dataclass
class Manifest:
    """A store's manifest.json (`store.manifest`): the `settings` that shape its rows (model,
    points, data, context, dtype...), its columns (`points`: activations; `meta`: token_ids,
    doc_ids, positions, seq_ids), its `shards` with rows and checksums, and per-point `stats`.
    docs/store-format.md gives every field."""

    settings: dict[str, Any]
    world_size: int = 1  # of the attempt that wrote this manifest (the latest one, once merged)
    points: dict[str, Column] = field(default_factory=dict)  # activations, one per hook point
    meta: dict[str, Column] = field(default_factory=dict)  # token_ids, doc_ids, positions, seq_ids
    shards: list[ShardEntry] = field(default_factory=list)
    stats: dict[str, PointStats] = field(default_factory=dict)
    settings_hash: str = ""
    generation: int = 0  # the attempt that wrote it: 0, then 1, 2... each time the world size changes
    version: int = VERSION  # 1 for a store written before elastic resume: readable, not resumable

    def __post_init__(self) -> None:
        if not self.settings_hash:
            self.settings_hash = settings_hash(self.settings)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    @property
    def columns(self) -> dict[str, Column]:
        return {**self.points, **self.meta}

    def done_batches(self, rank: int | None = None) -> set[int]:
        """Batch indices committed to shards (of one rank, or of all)."""
        return {b for s in self.shards if rank is None or s.rank == rank for b in s.batch_indices()}

    def to_json(self, shards: Any = None) -> dict[str, Any]:
        """The manifest as JSON; `shards`, if given, stands in for the list of shard entries."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "settings_hash": self.settings_hash,
            "settings": self.settings,
            "generation": self.generation,
            "world_size": self.world_size,
            "rows": self.rows,
            "bytes": self.bytes,
            "points": {k: {"shape": list(c.shape), "dtype": c.dtype} for k, c in self.points.items()},
            "meta": {k: {"shape": list(c.shape), "dtype": c.dtype} for k, c in self.meta.items()},
            "stats": {k: s.to_json() for k, s in self.stats.items()},
            "shards": [s.to_json() for s in self.shards] if shards is None else shards,
        }

    def to_bytes(self, texts: dict[str, str] | None = None) -> bytes:
        """The manifest file's exact bytes: `json.dumps(self.to_json(), indent=1)` and a newline.
        `texts` keeps each shard entry's text by file, so that a writer rewriting its manifest
        encodes only the entries it has not encoded before (json's indented encoder is pure Python)."""
        texts = {} if texts is None else texts
        if not self.shards:
            return (json.dumps(self.to_json(), indent=1, allow_nan=False) + "\n").encode()
        head = json.dumps(self.to_json(_SHARDS), indent=1, allow_nan=False)  # the last key, replaced below
        for s in self.shards:  # an entry at depth 2: its own indented text, two spaces further in
            if s.file not in texts:
                texts[s.file] = json.dumps(s.to_json(), indent=1, allow_nan=False).replace("\n", "\n  ")
        entries = ",".join(f"\n  {texts[s.file]}" for s in self.shards)
        return (head.removesuffix(f'"{_SHARDS}"\n}}') + f"[{entries}\n ]\n}}\n").encode()

    @classmethod
    def load(cls, path: str | os.PathLike) -> Manifest:
        path = Path(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise StoreError(f"{path}: no manifest here; is this a hookscope store directory?") from None
        except OSError as e:
            raise StoreError(f"{path}: manifest is not readable ({e}); the store is damaged") from e
        return cls.from_bytes(data, str(path))

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Manifest:
        """Parse and check a manifest's bytes; `where` names it in errors."""
        path = where
        # a million small objects (100,000 shards), no cycles: collections would double the time
        with collector.paused():
            try:
                raw = json.loads(data.decode("utf-8"))
            except (ValueError, RecursionError) as e:  # ValueError: bad UTF-8 / JSON, a 5,000-digit int
                raise StoreError(f"{path}: manifest is not readable JSON ({e}); the store is damaged") from e
            try:
                return cls._from_json(raw)
            except (KeyError, TypeError, ValueError) as e:
                raise StoreError(f"{path}: malformed manifest: {e}") from e

    @classmethod
    def _from_json(cls, raw: Any) -> Manifest:
        expect(raw, dict, "manifest")
        if raw.get("format") != FORMAT:
            raise ValueError(f"'format' is {raw.get('format')!r}, expected {FORMAT!r}")
        version = raw.get("version")
        if version not in (1, VERSION) or isinstance(version, bool):
            raise ValueError(f"format version {version!r}; this hookscope reads versions 1 and {VERSION}")
        settings = expect(raw["settings"], dict, "settings")
        stored_hash = expect(raw["settings_hash"], str, "settings_hash")
        if stored_hash != settings_hash(settings):
            raise ValueError("settings_hash does not match the settings (edited by hand?)")
        world_size = nonnegative(raw["world_size"], "world_size", minimum=1)
        raw_shards = expect(raw["shards"], list, "shards")
        shards = (
            [shard_v1_from_json(s, i, world_size) for i, s in enumerate(raw_shards)]
            if version == 1
            else [shard_from_json(s, f"shards[{i}]") for i, s in enumerate(raw_shards)]
        )
        m = cls(
            settings=settings,
            world_size=world_size,
            points=_columns(raw["points"], "points"),
            meta=_columns(raw["meta"], "meta"),
            shards=shards,
            stats={
                k: stats_from_json(v, f"stats.{k}") for k, v in expect(raw["stats"], dict, "stats").items()
            },
            settings_hash=stored_hash,
            generation=0 if version == 1 else nonnegative(raw["generation"], "generation"),
            version=version,
        )
        if nonnegative(raw["rows"], "rows") != m.rows or nonnegative(raw["bytes"], "bytes") != m.bytes:
            raise ValueError("totals 'rows'/'bytes' disagree with the shard list")
        for where, stats in [
            ("stats", m.stats),
            *((f"shards[{i}].stats", s.stats or {}) for i, s in enumerate(m.shards)),
        ]:
            check_stats(stats, m.points, where)
        if version != 1 and m.stats != summed_stats(m.shards):
            raise ValueError("'stats' disagree with the sum of the shards' stats")
        if len({s.file for s in m.shards}) != len(m.shards):
            raise ValueError("a shard file is listed twice")
        row_bytes = m.row_bytes
        for i, s in enumerate(m.shards):
            check_fits(s, row_bytes, f"shards[{i}]")
        return m

    @property
    def row_bytes(self) -> int:
        """Bytes of one row over every column."""
        return sum(c.row_bytes for c in self.columns.values())


def check_stats(stats: dict[str, PointStats], points: dict[str, Column], where: str) -> None:
    """Statistics only for the store's points (their per-dimension side is in the shards' headers:
    store/dimstats.py checks it)."""
    for name in stats:
        if name not in points:
            raise ValueError(f"{where} has {name!r}, which is not a point of the store")


def _columns(raw: Any, what: str) -> dict[str, Column]:
    out = {}
    for name, c in expect(raw, dict, what).items():
        expect(c, dict, f"{what}.{name}")
        shape = tuple(
            nonnegative(d, f"{what}.{name}.shape") for d in expect(c["shape"], list, f"{what}.{name}.shape")
        )
        dtype = expect(c["dtype"], str, f"{what}.{name}.dtype")
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"{what}.{name}.dtype {dtype!r} is not a torch dtype")
        out[name] = Column(shape, dtype)
    return out
