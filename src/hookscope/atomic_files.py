"""Writing a local file whole or not at all: the bytes go to a temporary file beside it, which is
then renamed over it, so that a reader (or a crash) never sees half a file. The file gets the
umask's mode, as a plain `open(path, "w")` would."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: bytes, *, durable: bool = False) -> Path:
    """Write `data` to `path` atomically.
    `durable` also fsyncs the file and then its directory, so the new file survives a power cut:
    the store's commits (shards, manifest), renamed with os.replace, which the fault tests count;
    any other file is renamed with os.rename (the same atomic rename on POSIX). The temporary file
    is removed on any failure, so a full disk gets its blocks back."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data)
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        else:
            os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)
    return path


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (POSIX needs the directory itself synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
