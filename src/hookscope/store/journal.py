"""Commit records: one self-checking line per shard, appended beside a manifest, so that committing
the 100,000th shard costs what the first did.

A writer commits a shard by appending its entry to its manifest's journal (`manifest.journal`
beside `manifest.json`, `manifest.rank1.journal` beside `manifest.rank1.json`...) and syncing it.
The manifest itself is rewritten ("compacted": every entry in it, the journal removed after) when
the writer opens, when the store's columns become known (its first shard), when the journal has
grown as long as the manifest (so a run rewrites O(shards) bytes in all), and at close. A store's
committed state is its manifest plus its journal's entries; entries already in the manifest (a
crash between a compaction and the journal's removal) count once. At a URL, where an object cannot
be appended to, each entry is an object of its own: `manifest.journal/<shard name>`.

A line is `<SHA-256 of the JSON, hex> <the entry as JSON>\\n`. A crash mid-append leaves at most
the last line torn (no newline, or a failed check): that shard was not committed. Any other line
that fails its check, or an entry that contradicts the manifest, is damage: a StoreError naming it.
See docs/store-format.md.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path

from ..atomic_files import fsync_dir
from ..errors import StoreError
from .card import CARD, card_bytes
from .fs import FS, Part
from .manifest import (
    SHARDS_DIR,
    VERSION,
    Column,
    Manifest,
    ShardEntry,
    check_fits,
    check_stats,
    shard_from_json,
    shard_prefix,
    summed_stats,
)
from .stats import PointStats

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Windows: no lock there
    fcntl = None

SUFFIX = ".journal"
COMPACT_AFTER = 1024  # journal lines at least, before a compaction mid-run


def journal_name(manifest: str) -> str:
    """`manifest.json` -> `manifest.journal`, `manifest.rank1.gen2.json` -> `manifest.rank1.gen2.journal`."""
    return manifest.removesuffix(".json") + SUFFIX


def record(entry: ShardEntry) -> bytes:
    """One journal line: the entry's JSON, preceded by its SHA-256."""
    body = json.dumps(entry.to_json(), separators=(",", ":"), allow_nan=False).encode()
    return hashlib.sha256(body).hexdigest().encode() + b" " + body + b"\n"


class _Torn(ValueError):
    """A line whose text does not match its SHA-256: cut short by a crash (if last), or edited."""


def _entry(line: bytes) -> ShardEntry:
    digest, _, body = line.partition(b" ")
    if hashlib.sha256(body).hexdigest().encode() != digest:
        raise _Torn("its SHA-256 does not match its text (torn or edited)")
    try:
        raw = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"not JSON ({e})") from e
    try:
        return shard_from_json(raw, "entry")
    except (KeyError, TypeError) as e:
        raise ValueError(f"malformed entry: {e!r}") from e


def read_journal(fs: FS, name: str) -> list[tuple[str, ShardEntry]]:
    """(where, entry) of every committed record of journal `name` ([] if there is none)."""
    where = fs.where(name)
    if fs.remote:  # one listing, then every record in one concurrent batch of GETs
        parts = [Part(f"{name}/{n}", 0, size) for n, size in sorted(fs.sizes(name).items())]
        lines = [
            (fs.where(rel), data)
            for (rel, _, _), data in zip(parts, fs.read_parts(parts), strict=True)
            if not isinstance(data, StoreError) or fs.size(rel) is not None
        ]
        for _, data in lines:  # one gone since the listing was compacted into the manifest, read after
            if isinstance(data, StoreError):
                raise data
        lines = [(at, data.removesuffix(b"\n")) for at, data in lines]
        torn_allowed = False  # an object is written whole or not at all
    else:
        try:
            data = fs.read(name)
        except FileNotFoundError:
            return []
        parts = data.split(b"\n")  # the last part: b"" after a whole last line, else a torn tail
        lines = [(f"{where} line {k + 1}", p) for k, p in enumerate(parts[:-1])]  # a line counts once whole
        torn_allowed = True
    out = []
    for k, (at, line) in enumerate(lines):
        try:
            out.append((at, _entry(line)))
        except ValueError as e:  # a whole line with a bad entry is damage even when last
            if torn_allowed and k == len(lines) - 1 and isinstance(e, _Torn):
                break  # the last line, cut short by a crash mid-append: that shard was not committed
            raise StoreError(
                f"{at}: {e}; the store's commit journal is damaged. Re-run the extraction "
                "into a new directory"
            ) from None
    return out


def _rank_of(manifest: str) -> int:
    m = re.fullmatch(r"manifest\.rank(\d+)(?:\.gen\d+)?\.json", manifest)
    return int(m.group(1)) if m else 0


def applied(m: Manifest, records: list[tuple[str, ShardEntry]], manifest: str) -> Manifest:
    """Manifest `m` (file `manifest`) with its journal's `records` committed, each checked against it."""
    known = {s.file: s for s in m.shards}
    new = []
    prefix = f"{SHARDS_DIR}/{shard_prefix(_rank_of(manifest), m.generation)}"
    for at, e in records:
        seen = known.get(e.file)
        if seen is not None:
            if seen != e:
                raise StoreError(
                    f"{at}: {e.file} is committed twice, with different entries; the store "
                    "is damaged. Re-run the extraction into a new directory"
                )
            continue  # already in the manifest (compacted, then a crash before the journal went)
        _check_entry(m, e, at, manifest, prefix)
        known[e.file] = e
        new.append(e)
    if not new:
        return m
    shards = sorted([*m.shards, *new], key=lambda s: s.batch_start)
    _check_each_batch_once(shards, manifest)
    return dataclasses.replace(m, shards=shards, stats=summed_stats(shards))


def _check_entry(m: Manifest, e: ShardEntry, at: str, manifest: str, prefix: str) -> None:
    """A journal's new entry `e` (read `at`) can belong to manifest `m` (file `manifest`): this
    writer's shard (file name starting with `prefix`), of the manifest's columns and points."""
    rank = _rank_of(manifest)
    if (
        m.version != VERSION
        or e.rank != rank
        or e.generation != m.generation
        or not e.file.startswith(prefix)
    ):
        raise StoreError(
            f"{at}: an entry for {e.file} (rank {e.rank}, attempt {e.generation}) cannot "
            f"belong to {manifest} (rank {rank}, attempt {m.generation}); the store is "
            "damaged"
        )
    if not m.columns:
        raise StoreError(f"{at}: an entry, but {manifest} lists no columns yet; the store is damaged")
    try:
        check_fits(e, m.row_bytes, at)
    except ValueError as err:
        raise StoreError(str(err)) from None
    if set(e.stats or {}) != set(m.points):
        raise StoreError(
            f"{at}: {e.file} has stats for {sorted(e.stats or {})}, the store's points "
            f"are {sorted(m.points)}; the store is damaged"
        )
    try:
        check_stats(e.stats or {}, m.points, f"{at}: stats")
    except ValueError as err:
        raise StoreError(f"{err}; the store is damaged") from None


def _check_each_batch_once(shards: list[ShardEntry], manifest: str) -> None:
    """No batch is in two of a manifest's `shards` (its own and its journal's)."""
    holder: dict[int, str] = {}
    for s in shards:
        for b in s.batch_indices():
            if holder.setdefault(b, s.file) != s.file:
                raise StoreError(
                    f"{manifest} and {journal_name(manifest)}: batch {b} is in both {holder[b]} "
                    f"and {s.file}; the store is damaged. Re-run the extraction into a new "
                    "directory"
                )


def load_manifest(fs: FS, name: str) -> Manifest:
    """Manifest `name` with its journal applied: every shard committed to it. The journal is read
    first, so a compaction in between (which only moves entries into the manifest) loses none.
    FileNotFoundError if there is no such manifest."""
    records = read_journal(fs, journal_name(name))
    m = Manifest.from_bytes(fs.read(name), fs.where(name))
    return applied(m, records, name) if records else m


def with_shard(
    old: Manifest, entry: ShardEntry, layout: dict[str, Column], stats: dict[str, PointStats]
) -> Manifest:
    """`old` with `entry` committed: kept in order of first batch, stats summed in that order. The
    shard list is `old`'s own, grown in place (a copy would cost O(shards) per commit): `Commits`
    calls it once the entry is durable, or on a copy when it rewrites the whole manifest."""
    shards = old.shards
    if shards and shards[-1].batch_start > entry.batch_start:  # among earlier attempts' shards
        bisect.insort(shards, entry, key=lambda s: s.batch_start)
        totals = summed_stats(shards)
    else:  # appended: the same sums as summed_stats(shards), without going over every shard again
        shards.append(entry)
        totals = {**old.stats, **{k: old.stats.get(k, PointStats()).merge(s) for k, s in stats.items()}}
    return dataclasses.replace(old, shards=shards, stats=totals, **_columns(layout, stats))


def _columns(layout: dict[str, Column], stats: dict[str, PointStats]) -> dict[str, dict[str, Column]]:
    """The manifest's `points` (the columns with statistics) and `meta` (the others)."""
    return {
        "points": {k: c for k, c in layout.items() if k in stats},
        "meta": {k: c for k, c in layout.items() if k not in stats},
    }


class Commits:
    """One writer's commits to manifest `name`: a journal line each, the manifest compacted now and then."""

    def __init__(self, fs: FS, name: str, *, puts_card: bool = True):
        self.fs = fs
        self.name = name
        self.journal = journal_name(name)
        # in a local store one writer puts the card: two ranks' renames of one README.md.tmp collide
        self.puts_card = puts_card or fs.remote
        self.lines = 0  # journal records since the manifest was last written
        self.based = 0  # shards in the manifest as last written
        self.texts: dict[str, str] = {}  # each entry's text in the manifest, encoded once (to_bytes)
        self._lock: tuple[int, Path] | None = None

    def lock(self) -> None:
        """Refuse a second writer of this manifest while this one runs: an exclusive `flock` on
        `<manifest>.lock` (local stores; the kernel releases it when the process dies, however)."""
        if self.fs.remote or fcntl is None:
            return
        path = self.fs.local(self.name.removesuffix(".json") + ".lock")
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise StoreError(
                    f"{self.fs.where(self.name)}: another run is writing this store right now "
                    "(it holds the lock on " + path.name + "); let it finish or stop it, then "
                    "run this again (it resumes)"
                ) from None
            try:  # the file a writer closing just then unlinked is no lock: take the one now there
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    self._lock = (fd, path)
                    return
            except FileNotFoundError:
                pass
            os.close(fd)

    def unlock(self) -> None:
        if self._lock is not None:
            fd, path = self._lock
            self._lock = None
            with contextlib.suppress(OSError):
                os.unlink(path)  # before the close: a finished store holds no lock file
            os.close(fd)

    def open(self, manifest: Manifest, found: Manifest | None) -> None:
        """At open: `manifest` is what this writer starts from, `found` what its manifest file (with
        its journal) holds. Written unless the file already says exactly that, as after a resume of
        a finished store (rewriting 100,000 entries costs seconds); then the store card is put
        again instead (by the writer that puts it; for the others the lock file taken proves it),
        which proves the directory writable before any compute."""
        if found is None or found != manifest or self._journal_left():
            self.compact(manifest)
        else:
            self.based = len(manifest.shards)
            self.put_card()

    def put_card(self) -> None:
        if self.puts_card:
            self.fs.put(CARD, card_bytes(), durable=False)

    def _journal_left(self) -> bool:
        return bool(self.fs.list(self.journal)) if self.fs.remote else self.fs.size(self.journal) is not None

    def compact(self, manifest: Manifest) -> None:
        """Write the whole manifest, then drop the journal, whose entries it now holds."""
        self.fs.put(self.name, manifest.to_bytes(self.texts))
        self.lines = 0
        self.based = len(manifest.shards)
        with contextlib.suppress(OSError):  # left behind, its entries are in the manifest: harmless
            self.fs.remove_tree(self.journal)

    def commit(
        self, old: Manifest, entry: ShardEntry, layout: dict[str, Column], stats: dict[str, PointStats]
    ) -> Manifest:
        """Commit `entry` durably; the manifest with it. Raises if it is not committed."""
        columns = _columns(layout, stats)
        if {**columns["points"], **columns["meta"]} != old.columns or self.lines >= max(
            COMPACT_AFTER, self.based
        ):
            new = with_shard(dataclasses.replace(old, shards=list(old.shards)), entry, layout, stats)
            self.compact(new)  # the whole manifest rewritten: O(shards) now and then, on a copy
            return new
        self.append(entry)  # durable: only now does the shard list in memory hold it
        return with_shard(old, entry, layout, stats)

    def append(self, entry: ShardEntry) -> None:
        line = record(entry)
        if self.fs.remote:
            self.fs.put(f"{self.journal}/{entry.file.rsplit('/', 1)[-1].removesuffix('.safetensors')}", line)
        else:
            _append(self.fs.local(self.journal), line)
        self.lines += 1

    def finish(self, manifest: Manifest) -> None:
        """At close: the manifest alone holds every entry."""
        if self.lines:
            self.compact(manifest)


def _append(path: Path, data: bytes) -> None:
    """Add `data` at the end of the local file `path` (made if missing) and sync it; on a failure the
    file is cut back to its old length, so a line that did not commit leaves nothing behind."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        start = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)
    if start == 0:  # a new file: its name must survive a power cut too
        fsync_dir(path.parent)
