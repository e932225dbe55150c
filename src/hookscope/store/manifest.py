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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import StoreError
from .checksum import ALGORITHMS
from .stats import PointStats

FORMAT = "hookscope-store"
VERSION = 2  # 2: shards list their batches explicitly and carry their own stats (elastic resume)
MANIFEST = "manifest.json"
SHARDS_DIR = "shards"
IDENTITY = "hookscope.shard"  # the shard's __metadata__ key naming its place in its store


Runs = tuple[tuple[int, int, int], ...]  # (first, last, step) runs of batch indices, increasing


def runs_of(indices: list[int]) -> Runs:
    """Increasing batch indices as (first, last, step) runs, greedily: [0, 2, 4, 5] gives
    (0, 4, 2), (5, 5, 1)."""
    runs, i = [], 0
    while i < len(indices):
        if i + 1 == len(indices):
            runs.append((indices[i], indices[i], 1))
            break
        step, j = indices[i + 1] - indices[i], i + 1
        while j + 1 < len(indices) and indices[j + 1] - indices[j] == step:
            j += 1
        runs.append((indices[i], indices[j], step))
        i = j + 1
    return tuple(runs)


def _show_runs(runs: Runs, steps: bool = True) -> str:
    return ",".join(f"{a}-{b}" + (f"/{s}" if steps and s != 1 else "") for a, b, s in runs)


def shard_identity(settings_hash: str, batches: Runs, rank: int) -> dict[str, str]:
    """What a shard's safetensors `__metadata__` says about where it belongs. A reader refuses a
    shard whose identity differs from its manifest entry: one copied from another store, or moved
    within this one, would otherwise read as valid rows. One key: safetensors writes metadata keys
    in a random order, and shards must be byte-identical from run to run. A shard of one process
    holding batches 0 to 7 says `batches 0-7 of rank 0, settings HASH`, as in format version 1."""
    return {IDENTITY: f"batches {_show_runs(batches)} of rank {rank}, settings {settings_hash}"}


def manifest_name(rank: int, world_size: int, generation: int = 0) -> str:
    """`manifest.json` for a single process; `manifest.rank{r}.json` per rank under torchrun, and
    `manifest.rank{r}.gen{g}.json` for the ranks of a later attempt with another world size."""
    if world_size == 1:
        return MANIFEST
    return f"manifest.rank{rank}.json" if generation == 0 else f"manifest.rank{rank}.gen{generation}.json"


def shard_prefix(rank: int, generation: int = 0) -> str:
    """The start of every shard file name of `rank` in attempt `generation` (0: as in version 1)."""
    return f"shard-r{rank:03d}-" if generation == 0 else f"shard-g{generation:03d}-r{rank:03d}-"


def canonical_json(value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise StoreError("store settings must be plain JSON "
                         f"(str, int, float, bool, None, list, dict): {e}") from e


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


@dataclass(frozen=True)
class ShardEntry:
    file: str  # relative to the store directory, e.g. "shards/shard-r000-000003.safetensors"
    rows: int
    checksum: str  # hex digest of the whole file, by `algorithm` (store/checksum.py)
    bytes: int
    batches: Runs  # the batch indices the shard holds, in row order, as (first, last, step) runs
    rank: int
    generation: int = 0  # the attempt (a run of one world size) that wrote it
    stats: dict[str, PointStats] | None = field(default=None, hash=False)  # None: format version 1
    legacy: bool = field(default=False, compare=False, repr=False)  # read from format version 1
    algorithm: str = "sha256"  # of `checksum`; the JSON keeps the digest under this name

    @property
    def batch_start(self) -> int:
        return self.batches[0][0]

    @property
    def batch_end(self) -> int:
        return self.batches[-1][1]

    def batch_indices(self) -> list[int]:
        return [b for first, last, step in self.batches for b in range(first, last + 1, step)]

    def identity(self, settings_hash: str) -> str:
        """The identity string the shard file's metadata must hold (see `shard_identity`)."""
        if self.legacy:  # version 1 wrote first-last only, the step being the world size
            runs = _show_runs(self.batches, steps=False)
            return f"batches {runs} of rank {self.rank}, settings {settings_hash}"
        return shard_identity(settings_hash, self.batches, self.rank)[IDENTITY]

    def to_json(self) -> dict[str, Any]:
        out = {"file": self.file, "rows": self.rows, self.algorithm: self.checksum, "bytes": self.bytes,
               "batches": [list(r) for r in self.batches], "rank": self.rank, "generation": self.generation}
        if self.stats is not None:
            out["stats"] = {k: s.to_json() for k, s in self.stats.items()}
        return out


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
    doc_ids, positions, seq_ids), its `shards` with rows and SHA-256, and per-point `stats`.
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

    def to_json(self) -> dict[str, Any]:
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
            "shards": [s.to_json() for s in self.shards],
        }

    def to_bytes(self) -> bytes:
        """The manifest file's exact bytes."""
        return (json.dumps(self.to_json(), indent=1, allow_nan=False) + "\n").encode()

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
        _expect(raw, dict, "manifest")
        if raw.get("format") != FORMAT:
            raise ValueError(f"'format' is {raw.get('format')!r}, expected {FORMAT!r}")
        version = raw.get("version")
        if version not in (1, VERSION) or isinstance(version, bool):
            raise ValueError(f"format version {version!r}; this hookscope reads versions 1 and {VERSION}")
        settings = _expect(raw["settings"], dict, "settings")
        stored_hash = _expect(raw["settings_hash"], str, "settings_hash")
        if stored_hash != settings_hash(settings):
            raise ValueError("settings_hash does not match the settings (edited by hand?)")
        world_size = _int(raw["world_size"], "world_size", minimum=1)
        raw_shards = _expect(raw["shards"], list, "shards")
        shards = ([_shard_v1(s, i, world_size) for i, s in enumerate(raw_shards)] if version == 1
                  else [_shard(s, i) for i, s in enumerate(raw_shards)])
        m = cls(
            settings=settings,
            world_size=world_size,
            points=_columns(raw["points"], "points"),
            meta=_columns(raw["meta"], "meta"),
            shards=shards,
            stats={k: _stats(v, f"stats.{k}") for k, v in _expect(raw["stats"], dict, "stats").items()},
            settings_hash=stored_hash,
            generation=0 if version == 1 else _int(raw["generation"], "generation"),
            version=version,
        )
        if _int(raw["rows"], "rows") != m.rows or _int(raw["bytes"], "bytes") != m.bytes:
            raise ValueError("totals 'rows'/'bytes' disagree with the shard list")
        for where, stats in [("stats", m.stats), *((f"shards[{i}].stats", s.stats or {})
                                                   for i, s in enumerate(m.shards))]:
            for name, st in stats.items():
                if name not in m.points:
                    raise ValueError(f"{where} has {name!r}, which is not a point of the store")
                if st.mean is not None and len(st.mean) != math.prod(m.points[name].shape):
                    raise ValueError(f"{where}.{name} holds {len(st.mean)} dimensions, the point has "
                                     f"{math.prod(m.points[name].shape)}")
        if version != 1 and m.stats != summed_stats(m.shards):
            raise ValueError("'stats' disagree with the sum of the shards' stats")
        if len({s.file for s in m.shards}) != len(m.shards):
            raise ValueError("a shard file is listed twice")
        row_bytes = sum(c.row_bytes for c in m.columns.values())
        for i, s in enumerate(m.shards):  # bounds what a reader allocates from the manifest's word alone
            if s.rows * row_bytes > s.bytes:
                raise ValueError(f"shards[{i}] ({s.file}) claims {s.rows} rows of {row_bytes} bytes each, "
                                 f"more than its {s.bytes} bytes: the manifest or the shard is damaged")
        return m


def _expect(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{what} should be {kind.__name__}, got {type(value).__name__}")
    return value


def _int(value: Any, what: str, minimum: int = 0) -> int:
    _expect(value, int, what)
    if value < minimum:
        raise ValueError(f"{what} is {value}, should be >= {minimum}")
    return value


def _columns(raw: Any, what: str) -> dict[str, Column]:
    out = {}
    for name, c in _expect(raw, dict, what).items():
        _expect(c, dict, f"{what}.{name}")
        shape = tuple(_int(d, f"{what}.{name}.shape")
                      for d in _expect(c["shape"], list, f"{what}.{name}.shape"))
        dtype = _expect(c["dtype"], str, f"{what}.{name}.dtype")
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"{what}.{name}.dtype {dtype!r} is not a torch dtype")
        out[name] = Column(shape, dtype)
    return out


def _shard_common(raw: Any, w: str) -> tuple[str, int, str, int, int, str]:
    _expect(raw, dict, w)
    file = _expect(raw["file"], str, f"{w}.file")
    if not file.startswith(SHARDS_DIR + "/") or ".." in file or not file.endswith(".safetensors"):
        raise ValueError(f"{w}.file {file!r} should be shards/<name>.safetensors")
    named = [a for a in ALGORITHMS if a in raw]
    if len(named) != 1:
        raise ValueError(f"{w} should hold one checksum, under one of {list(ALGORITHMS)}; it holds {named}")
    algorithm = named[0]
    digest = _expect(raw[algorithm], str, f"{w}.{algorithm}")
    if len(digest) != ALGORITHMS[algorithm] or any(ch not in "0123456789abcdef" for ch in digest):
        raise ValueError(f"{w}.{algorithm} {digest!r} is not a hex {algorithm} digest")
    rows, size, rank = (_int(raw[k], f"{w}.{k}") for k in ("rows", "bytes", "rank"))
    return file, rows, digest, size, rank, algorithm


def _shard(raw: Any, i: int) -> ShardEntry:
    w = f"shards[{i}]"
    file, rows, digest, size, rank, algorithm = _shard_common(raw, w)
    runs = []
    for j, run in enumerate(_expect(raw["batches"], list, f"{w}.batches")):
        if not isinstance(run, list) or len(run) != 3:
            raise ValueError(f"{w}.batches[{j}] should be [first, last, step]")
        first, last, step = (_int(x, f"{w}.batches[{j}]") for x in run)
        if last < first or step < 1 or (last - first) % step or (runs and first <= runs[-1][1]):
            raise ValueError(f"{w}.batches[{j}] {run} is not an increasing run after the ones before it")
        runs.append((first, last, step))
    if not runs:
        raise ValueError(f"{w}.batches is empty")
    stats = {k: _stats(v, f"{w}.stats.{k}") for k, v in _expect(raw["stats"], dict, f"{w}.stats").items()}
    generation = _int(raw["generation"], f"{w}.generation")
    return ShardEntry(file, rows, digest, size, tuple(runs), rank, generation, stats, algorithm=algorithm)


def _shard_v1(raw: Any, i: int, world_size: int) -> ShardEntry:
    """A version 1 entry: batch_start..batch_end stepping by the world size."""
    w = f"shards[{i}]"
    file, rows, digest, size, rank, algorithm = _shard_common(raw, w)
    start, end = _int(raw["batch_start"], f"{w}.batch_start"), _int(raw["batch_end"], f"{w}.batch_end")
    if end < start or (end - start) % world_size:
        raise ValueError(f"{w}: batch_start..batch_end ({start}..{end}) is no run of step {world_size}")
    return ShardEntry(file, rows, digest, size, ((start, end, world_size),), rank, legacy=True,
                      algorithm=algorithm)


def _stats(raw: Any, where: str) -> PointStats:
    return PointStats.from_json(raw, where)
