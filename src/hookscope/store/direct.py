"""A shard's bytes written around the page cache (`O_DIRECT`), on filesystems of a block device.

A buffered write copies every byte into the page cache in the kernel, one 4 KiB page at a time
(allocated, charged, marked dirty), under the file's lock: that copy can cost more CPU than
the rest of the writer and set the pace of an extraction to disk, while an O_DIRECT write of
the same bytes costs the CPU almost nothing and runs at the disk's own rate (bench/HISTORY.md,
Writer, "Shards written around the page cache"). Here the bytes are gathered into page-aligned buffers
of `BLOCK` bytes, each written at its aligned offset once full while the next one fills; the last
partial block is written through the page cache (O_DIRECT wants whole blocks). The file's bytes
are the same, and it is still fsynced before it counts.

Used where the directory's filesystem is one of `BLOCK_FILESYSTEMS` (read from
/proc/self/mountinfo) or an overlay over one (a container's filesystem: `on_a_disk`), never on
tmpfs (memory already) or a network or FUSE filesystem, and not where `HOOKSCOPE_DIRECT_WRITES=0`.
A filesystem that refuses O_DIRECT at the open or at a write gets the rest of the file through the
page cache.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Windows (nor O_DIRECT): no direct writes there
    fcntl = None

BLOCK = 8 * 2**20  # bytes per direct write (4-16 MiB ran alike here; large requests keep a device busy)
ALIGN = 4096  # O_DIRECT's unit (a device's logical block is 512 or 4096 bytes)
BLOCK_FILESYSTEMS = frozenset({"ext4", "ext3", "ext2", "xfs", "btrfs", "f2fs", "jfs", "bcachefs"})
ENV = "HOOKSCOPE_DIRECT_WRITES"  # "0": always through the page cache


def wanted(directory: Path) -> bool:
    """Whether shards written in `directory` go around the page cache."""
    if os.environ.get(ENV, "").strip() == "0" or not hasattr(os, "O_DIRECT") or fcntl is None:
        return False
    return on_a_disk(directory)


def on_a_disk(directory: Path, mountinfo: str | None = None) -> bool:
    """Whether `directory` is on one of `BLOCK_FILESYSTEMS`, or on an overlay (a container's own
    filesystem) whose upper layer is on one, or whose upper layer this process cannot see: Docker's
    overlay2 keeps it on the host's disk, and a filesystem that refuses O_DIRECT still gets the
    file through the page cache. On an overlay over ext4, shard-sized files took O_DIRECT writes
    several times faster than the page cache (bench/HISTORY.md, Writer, "Overlay")."""
    text = _mountinfo(mountinfo)
    mount = _mount_of(directory, text)
    seen = set()
    while mount is not None and mount.kind == "overlay" and mount.id not in seen:
        seen.add(mount.id)
        upper = mount.option("upperdir")
        below = None if upper is None else _mount_of(Path(upper), text)
        if below is None or below.id in seen:  # the upper layer is out of this namespace's sight
            return upper is not None
        mount = below
    return mount is not None and mount.kind in BLOCK_FILESYSTEMS


def filesystem_of(directory: Path, mountinfo: str | None = None) -> str | None:
    """The type of the filesystem `directory` is on (the longest mount point above it) by
    `mountinfo` (the text of /proc/self/mountinfo, read when not given), or None where unknown."""
    mount = _mount_of(directory, _mountinfo(mountinfo))
    return None if mount is None else mount.kind


class _Mount(NamedTuple):
    id: str
    kind: str
    options: str  # the filesystem's own (mountinfo's last field)

    def option(self, name: str) -> str | None:
        values = [o.partition("=")[2] for o in self.options.split(",") if o.startswith(name + "=")]
        return _unescaped(values[0]) if values else None


def _mountinfo(text: str | None) -> str:
    try:
        return Path("/proc/self/mountinfo").read_text() if text is None else text
    except OSError:
        return ""


def _mount_of(directory: Path, mountinfo: str) -> _Mount | None:
    """The mount `directory` is on: the longest mount point above it in `mountinfo`'s text."""
    path = os.path.realpath(directory)
    best, found = "", None
    for line in mountinfo.splitlines():
        mount, sep, rest = line.partition(" - ")
        fields, super_fields = mount.split(), rest.split()
        if not sep or len(fields) < 5 or not super_fields:
            continue
        point = _unescaped(fields[4])
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best = point
            found = _Mount(fields[0], super_fields[0], super_fields[2] if len(super_fields) > 2 else "")
    return found


def _unescaped(field: str) -> str:
    """mountinfo writes some characters of a path as a backslash and 3 octal digits: a space, tab,
    newline or backslash in a mount point; also a comma or "=" in a filesystem's option."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def open_for_writing(path: Path, mode: int, direct: bool) -> tuple[int, bool]:
    """A new (truncated) file at `path` opened for writing, with O_DIRECT when `direct` and the
    filesystem takes it; (descriptor, whether O_DIRECT is on)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if direct:
        try:
            return os.open(path, flags | os.O_DIRECT, mode), True
        except OSError as e:  # a filesystem without O_DIRECT: through the page cache
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, flags, mode), False


class Bounce:
    """The two page-aligned buffers a writer's direct writes go through (made once, reused): one is
    filled while the other is written, by a thread of the write's own."""

    def __init__(self) -> None:
        self.buffers = [mmap.mmap(-1, BLOCK) for _ in range(2)]

    def write(self, fd: int, pieces: Sequence[memoryview]) -> None:
        """`pieces`, one after the other from offset 0 of `fd`, opened with `os.O_DIRECT`."""
        views = [memoryview(b) for b in self.buffers]
        writes: list[Future] = []
        in_flight: list[Future | None] = [None, None]  # each buffer's write
        with ThreadPoolExecutor(1, "hookscope-shard-direct") as writer:  # the writes, in order
            at, filled, turn = 0, 0, 0  # the file offset of the buffer's start, the bytes in it
            for piece in pieces:
                while piece:
                    if filled == 0 and in_flight[turn] is not None:
                        in_flight[turn].result()  # written (or raises): this buffer may be refilled
                    n = min(len(piece), BLOCK - filled)
                    views[turn][filled : filled + n] = piece[:n]
                    piece, filled = piece[n:], filled + n
                    if filled == BLOCK:
                        in_flight[turn] = writer.submit(write_at, fd, views[turn], at)
                        writes.append(in_flight[turn])
                        at, filled, turn = at + BLOCK, 0, 1 - turn
            whole = filled - filled % ALIGN
            if whole:
                writes.append(writer.submit(write_at, fd, views[turn][:whole], at))
            if filled > whole:  # the last partial block: through the page cache
                writes.append(
                    writer.submit(write_at, fd, views[turn][whole:filled], at + whole, through_cache=True)
                )
        for w in writes:
            w.result()  # the first error (a full disk), raised here


def write_at(fd: int, data: memoryview, offset: int, through_cache: bool = False) -> None:
    """Write all of `data` at `offset` of `fd` (`through_cache`: O_DIRECT turned off first). On a
    descriptor opened with O_DIRECT, a filesystem that refuses a direct write gets it, and the rest
    of the file, through the page cache."""
    if through_cache:
        _buffered(fd)
    while data:
        try:
            n = os.pwrite(fd, data, offset)
        except OSError as e:
            if e.errno != errno.EINVAL or not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                raise
            _buffered(fd)
            continue
        data, offset = data[n:], offset + n


def _buffered(fd: int) -> None:
    """O_DIRECT off on `fd`: its next writes go through the page cache."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
