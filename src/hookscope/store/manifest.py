"""The store's manifest: what a directory of shards holds, and the settings that made it.

The manifest is the single source of truth: a shard file not listed in it does not exist as far as
readers and resuming writers are concerned. It is replaced atomically (tmp + fsync + rename), so a
crash at any moment leaves either the old or the new manifest, never half of one.
See docs/store-format.md for the format on one page.
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

FORMAT = "hookscope-store"
VERSION = 1
MANIFEST = "manifest.json"
SHARDS_DIR = "shards"
IDENTITY = "hookscope.shard"  # the shard's __metadata__ key naming its place in its store


def shard_identity(settings_hash: str, batch_start: int, batch_end: int, rank: int) -> dict[str, str]:
    """What a shard's safetensors `__metadata__` says about where it belongs. A reader refuses a
    shard whose identity differs from its manifest entry: one copied from another store, or moved
    within this one, would otherwise read as valid rows. One key: safetensors writes metadata keys
    in a random order, and shards must be byte-identical from run to run."""
    return {IDENTITY: f"batches {batch_start}-{batch_end} of rank {rank}, settings {settings_hash}"}


def manifest_name(rank: int, world_size: int) -> str:
    """`manifest.json` for a single process; `manifest.rank{r}.json` per rank under torchrun."""
    return MANIFEST if world_size == 1 else f"manifest.rank{rank}.json"


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


@dataclass(frozen=True)
class ShardEntry:
    file: str  # relative to the store directory, e.g. "shards/shard-r000-000003.safetensors"
    rows: int
    sha256: str
    bytes: int
    batch_start: int  # first and last batch index in this shard (inclusive), stepping by world_size
    batch_end: int
    rank: int

    def batches(self, world_size: int) -> range:
        return range(self.batch_start, self.batch_end + 1, world_size)


def count_nonfinite(t: torch.Tensor) -> int:
    """NaN and +-Inf values in `t` (what `PointStats.nonfinite` counts)."""
    return int((~torch.isfinite(t)).sum())


@dataclass
class PointStats:
    """Mergeable per-point statistics: non-finite values, and count / sum / sum of squares of row L2
    norms over the rows that are entirely finite."""

    nonfinite: int = 0
    norm_count: int = 0
    norm_sum: float = 0.0
    norm_sumsq: float = 0.0

    @classmethod
    def of(cls, rows: torch.Tensor) -> PointStats:
        """The statistics of `rows` [rows, ...]."""
        flat = rows.reshape(rows.shape[0], -1).float()
        finite = torch.isfinite(flat)
        whole = finite.all(dim=1)
        norms = flat[whole].norm(dim=1).double()
        return cls(count_nonfinite(flat), int(whole.sum()), float(norms.sum()), float((norms**2).sum()))

    def merge(self, other: PointStats) -> PointStats:
        return PointStats(self.nonfinite + other.nonfinite, self.norm_count + other.norm_count,
                          self.norm_sum + other.norm_sum, self.norm_sumsq + other.norm_sumsq)

    @property
    def norm_mean(self) -> float:
        return self.norm_sum / self.norm_count if self.norm_count else math.nan

    @property
    def norm_std(self) -> float:
        if not self.norm_count:
            return math.nan
        return math.sqrt(max(self.norm_sumsq / self.norm_count - self.norm_mean**2, 0.0))


@dataclass
class Manifest:
    settings: dict[str, Any]
    world_size: int = 1
    points: dict[str, Column] = field(default_factory=dict)  # activations, one per hook point
    meta: dict[str, Column] = field(default_factory=dict)  # token_ids, doc_ids, positions, seq_ids
    shards: list[ShardEntry] = field(default_factory=list)
    stats: dict[str, PointStats] = field(default_factory=dict)
    settings_hash: str = ""

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
        return {b for s in self.shards if rank is None or s.rank == rank for b in s.batches(self.world_size)}

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "settings_hash": self.settings_hash,
            "settings": self.settings,
            "world_size": self.world_size,
            "rows": self.rows,
            "bytes": self.bytes,
            "points": {k: {"shape": list(c.shape), "dtype": c.dtype} for k, c in self.points.items()},
            "meta": {k: {"shape": list(c.shape), "dtype": c.dtype} for k, c in self.meta.items()},
            "stats": {k: vars(s).copy() for k, s in self.stats.items()},
            "shards": [vars(s).copy() for s in self.shards],
        }

    def to_bytes(self) -> bytes:
        """The manifest file's exact bytes."""
        return (json.dumps(self.to_json(), indent=1, allow_nan=False) + "\n").encode()

    def save(self, path: str | os.PathLike) -> None:
        """Atomic replace: a reader or a crash sees the old manifest or the new one, never a mix."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        data = self.to_bytes()
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # e.g. a full disk: give its blocks back
            raise
        fsync_dir(path.parent)

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
        if raw.get("version") != VERSION:
            raise ValueError(f"format version {raw.get('version')!r}; this hookscope reads version {VERSION}")
        settings = _expect(raw["settings"], dict, "settings")
        stored_hash = _expect(raw["settings_hash"], str, "settings_hash")
        if stored_hash != settings_hash(settings):
            raise ValueError("settings_hash does not match the settings (edited by hand?)")
        m = cls(
            settings=settings,
            world_size=_int(raw["world_size"], "world_size", minimum=1),
            points=_columns(raw["points"], "points"),
            meta=_columns(raw["meta"], "meta"),
            shards=[_shard(s, i) for i, s in enumerate(_expect(raw["shards"], list, "shards"))],
            stats={k: _stats(v, k) for k, v in _expect(raw["stats"], dict, "stats").items()},
            settings_hash=stored_hash,
        )
        if _int(raw["rows"], "rows") != m.rows or _int(raw["bytes"], "bytes") != m.bytes:
            raise ValueError("totals 'rows'/'bytes' disagree with the shard list")
        if len({s.file for s in m.shards}) != len(m.shards):
            raise ValueError("a shard file is listed twice")
        row_bytes = sum(math.prod(c.shape) * getattr(torch, c.dtype).itemsize for c in m.columns.values())
        for i, s in enumerate(m.shards):  # bounds what a reader allocates from the manifest's word alone
            if s.rows * row_bytes > s.bytes:
                raise ValueError(f"shards[{i}] ({s.file}) claims {s.rows} rows of {row_bytes} bytes each, "
                                 f"more than its {s.bytes} bytes: the manifest or the shard is damaged")
        return m


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (POSIX needs the directory itself synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _shard(raw: Any, i: int) -> ShardEntry:
    w = f"shards[{i}]"
    _expect(raw, dict, w)
    file = _expect(raw["file"], str, f"{w}.file")
    if not file.startswith(SHARDS_DIR + "/") or ".." in file or not file.endswith(".safetensors"):
        raise ValueError(f"{w}.file {file!r} should be shards/<name>.safetensors")
    sha = _expect(raw["sha256"], str, f"{w}.sha256")
    if len(sha) != 64 or any(ch not in "0123456789abcdef" for ch in sha):
        raise ValueError(f"{w}.sha256 {sha!r} is not a hex SHA-256")
    entry = ShardEntry(file, _int(raw["rows"], f"{w}.rows"), sha, _int(raw["bytes"], f"{w}.bytes"),
                       _int(raw["batch_start"], f"{w}.batch_start"), _int(raw["batch_end"], f"{w}.batch_end"),
                       _int(raw["rank"], f"{w}.rank"))
    if entry.batch_end < entry.batch_start:
        raise ValueError(f"{w}: batch_end < batch_start")
    return entry


def _stats(raw: Any, name: str) -> PointStats:
    _expect(raw, dict, f"stats.{name}")
    floats = [raw[k] for k in ("norm_sum", "norm_sumsq")]
    for k, v in zip(("norm_sum", "norm_sumsq"), floats, strict=True):
        if not isinstance(v, int | float) or isinstance(v, bool):
            raise TypeError(f"stats.{name}.{k} should be a number")
    return PointStats(_int(raw["nonfinite"], f"stats.{name}.nonfinite"),
                      _int(raw["norm_count"], f"stats.{name}.norm_count"), float(floats[0]), float(floats[1]))
