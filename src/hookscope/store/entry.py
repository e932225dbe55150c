"""One shard's entry in a manifest: its fields, the identity its file carries, and the check of its
JSON (every field, as a hostile file would have it). See docs/store-format.md."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .checksum import ALGORITHMS
from .stats import PointStats

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
        out = {
            "file": self.file,
            "rows": self.rows,
            self.algorithm: self.checksum,
            "bytes": self.bytes,
            "batches": [list(r) for r in self.batches],
            "rank": self.rank,
            "generation": self.generation,
        }
        if self.stats is not None:
            out["stats"] = {k: s.to_json() for k, s in self.stats.items()}
        return out


def check_fits(entry: ShardEntry, row_bytes: int, where: str) -> None:
    """Refuse an entry claiming more rows than its bytes hold: bounds what a reader allocates from
    the manifest's word alone."""
    if entry.rows * row_bytes > entry.bytes:
        raise ValueError(
            f"{where} ({entry.file}) claims {entry.rows} rows of {row_bytes} bytes each, "
            f"more than its {entry.bytes} bytes: the manifest or the shard is damaged"
        )


def expect(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{what} should be {kind.__name__}, got {type(value).__name__}")
    return value


def nonnegative(value: Any, what: str, minimum: int = 0) -> int:
    expect(value, int, what)
    if value < minimum:
        raise ValueError(f"{what} is {value}, should be >= {minimum}")
    return value


class _CommonFields(NamedTuple):
    """The fields version 1 and version 2 shard entries share, checked."""

    file: str
    rows: int
    digest: str
    size: int
    rank: int
    algorithm: str


def _shard_common(raw: Any, w: str) -> _CommonFields:
    expect(raw, dict, w)
    file = expect(raw["file"], str, f"{w}.file")
    if not file.startswith(SHARDS_DIR + "/") or ".." in file or not file.endswith(".safetensors"):
        raise ValueError(f"{w}.file {file!r} should be shards/<name>.safetensors")
    named = [a for a in ALGORITHMS if a in raw]
    if len(named) != 1:
        raise ValueError(f"{w} should hold one checksum, under one of {list(ALGORITHMS)}; it holds {named}")
    algorithm = named[0]
    digest = expect(raw[algorithm], str, f"{w}.{algorithm}")
    if len(digest) != ALGORITHMS[algorithm] or any(ch not in "0123456789abcdef" for ch in digest):
        raise ValueError(f"{w}.{algorithm} {digest!r} is not a hex {algorithm} digest")
    rows, size, rank = (nonnegative(raw[k], f"{w}.{k}") for k in ("rows", "bytes", "rank"))
    return _CommonFields(file, rows, digest, size, rank, algorithm)


def shard_from_json(raw: Any, w: str) -> ShardEntry:
    """A version 2 shard entry, every field checked; `w` names it in errors (e.g. `shards[3]`)."""
    return _plain_shard(raw) or _checked_shard(raw, w)


_HEX = re.compile(r"[0-9a-f]+")


def _plain_shard(raw: Any) -> ShardEntry | None:
    """The entry, if every field is as a writer writes it; else None, and `_checked_shard` says what is
    wrong. The same checks without their per-field calls: a 100,000-shard manifest opens in seconds."""
    if type(raw) is not dict:
        return None
    named = [a for a in ALGORITHMS if a in raw]
    if len(named) != 1:
        return None
    algorithm = named[0]
    file, digest, runs, stats = raw.get("file"), raw.get(algorithm), raw.get("batches"), raw.get("stats")
    ints = raw.get("rows"), raw.get("bytes"), raw.get("rank"), raw.get("generation")
    if (
        type(file) is not str
        or not file.startswith(SHARDS_DIR + "/")
        or ".." in file
        or not file.endswith(".safetensors")
        or type(digest) is not str
        or len(digest) != ALGORITHMS[algorithm]
        or not _HEX.fullmatch(digest)
        or any(type(v) is not int or v < 0 for v in ints)
        or type(runs) is not list
        or not runs
        or type(stats) is not dict
    ):
        return None
    batches, last = [], -1
    for run in runs:
        if type(run) is not list or len(run) != 3:
            return None
        first, end, step = run
        if (
            type(first) is not int
            or type(end) is not int
            or type(step) is not int
            or first <= last
            or end < first
            or step < 1
            or (end - first) % step
        ):
            return None
        batches.append((first, end, step))
        last = end
    try:  # the statistics' own checks (store/stats.py)
        point_stats = {name: PointStats.from_json(st, name) for name, st in stats.items()}
    except (KeyError, TypeError, ValueError):
        return None
    rows, size, rank, generation = ints
    return ShardEntry(
        file, rows, digest, size, tuple(batches), rank, generation, point_stats, algorithm=algorithm
    )


def _checked_shard(raw: Any, w: str) -> ShardEntry:
    file, rows, digest, size, rank, algorithm = _shard_common(raw, w)
    runs = []
    for j, run in enumerate(expect(raw["batches"], list, f"{w}.batches")):
        if not isinstance(run, list) or len(run) != 3:
            raise ValueError(f"{w}.batches[{j}] should be [first, last, step]")
        first, last, step = (nonnegative(x, f"{w}.batches[{j}]") for x in run)
        if last < first or step < 1 or (last - first) % step or (runs and first <= runs[-1][1]):
            raise ValueError(f"{w}.batches[{j}] {run} is not an increasing run after the ones before it")
        runs.append((first, last, step))
    if not runs:
        raise ValueError(f"{w}.batches is empty")
    stats = {
        k: stats_from_json(v, f"{w}.stats.{k}") for k, v in expect(raw["stats"], dict, f"{w}.stats").items()
    }
    generation = nonnegative(raw["generation"], f"{w}.generation")
    return ShardEntry(file, rows, digest, size, tuple(runs), rank, generation, stats, algorithm=algorithm)


def shard_v1_from_json(raw: Any, i: int, world_size: int) -> ShardEntry:
    """A version 1 entry: batch_start..batch_end stepping by the world size."""
    w = f"shards[{i}]"
    file, rows, digest, size, rank, algorithm = _shard_common(raw, w)
    start = nonnegative(raw["batch_start"], f"{w}.batch_start")
    end = nonnegative(raw["batch_end"], f"{w}.batch_end")
    if end < start or (end - start) % world_size:
        raise ValueError(f"{w}: batch_start..batch_end ({start}..{end}) is no run of step {world_size}")
    return ShardEntry(
        file, rows, digest, size, ((start, end, world_size),), rank, legacy=True, algorithm=algorithm
    )


def stats_from_json(raw: Any, where: str) -> PointStats:
    return PointStats.from_json(raw, where)
