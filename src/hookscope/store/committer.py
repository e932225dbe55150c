"""The writer's commit: each shard, written and in its final place, becomes part of the store (its
batches count as done), in shard order, on a thread of its own while the writer thread writes the
next shard: the disk flushes one shard as the next one's bytes are copied (one commit in flight at
most). A commit that finds the disk full is tried once more at close (`settle`)."""

from __future__ import annotations

import dataclasses
import errno
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .fs import FS
from .journal import Commits
from .manifest import Column, Manifest, ShardEntry
from .stats import PointStats


@dataclasses.dataclass(frozen=True)
class Stalled:
    """A shard whole and in place whose commit found the disk full: `Committer.settle` tries again."""

    entry: ShardEntry
    layout: dict[str, Column]
    stats: dict[str, PointStats]


class Committer:
    """Commits one writer's shards to its manifest (`commits`, locked), starting from `manifest`;
    `done_batches` grows as they commit. The caller's thread reads `manifest`, `done_batches` and
    `bytes_written` while the commit thread updates them."""

    def __init__(self, fs: FS, commits: Commits, manifest: Manifest, done_batches: set[int]):
        self.fs = fs
        self.manifest = manifest
        self.done_batches = done_batches  # grown in place by the commit thread
        self.bytes_written = 0  # this session, for a progress bar
        self._commits = commits
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="hookscope-shard-commit")
        self._in_flight: Future | None = None
        self._stalled: Stalled | None = None

    def start(self, place_and_commit: Callable[..., None], *args: Any) -> None:
        """Run `place_and_commit(*args)` (which ends in `commit`) on the commit thread; `wait` first."""
        self._in_flight = self._thread.submit(place_and_commit, *args)

    def wait(self) -> None:
        """Wait for the shard in flight to be committed; raise its error (it is not committed)."""
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            in_flight.result()

    def settle(self) -> None:
        """`wait`, at close, and a commit that found the disk full tried once more: the next shard's
        bytes, written meanwhile, may have taken the space it needed; they are deleted by now."""
        try:
            self.wait()
        except OSError:
            if self._stalled is None:
                raise
        stalled, self._stalled = self._stalled, None
        if stalled is not None:
            self.commit(
                stalled.entry, stalled.layout, stalled.stats
            )  # still no space: raises, and its shard is deleted

    def commit(
        self,
        entry: ShardEntry,
        layout: dict[str, Column],
        stats: dict[str, PointStats],
        last_try: bool = True,
    ) -> None:
        """Shard `entry`, in its final place, becomes part of the store (its batches count as done)."""
        try:  # rebinding, so the caller's thread always sees a whole manifest
            self.manifest = self._commits.commit(self.manifest, entry, layout, stats)
        except BaseException as e:
            if not last_try and isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                self._stalled = Stalled(entry, layout, stats)  # whole and in place: `settle` tries it again
            else:  # not committed: free its space; a resume would delete it anyway
                self.fs.remove(entry.file)
            raise
        self.done_batches.update(entry.batch_indices())  # in place: O(1) per shard, read by `in` only
        self.bytes_written += entry.bytes

    def shutdown(self) -> None:
        """Stop the commit thread (after `settle`: nothing is in flight)."""
        self._thread.shutdown()

    def finish(self) -> None:
        """At a close without error: the manifest alone holds every entry (store/journal.py)."""
        self._commits.finish(self.manifest)

    def unlock(self) -> None:
        """Let the store go: the next run may take it."""
        self._commits.unlock()
