"""Writing a local file whole or not at all: the bytes go to a temporary file beside it, which is
then renamed over it, so that a reader (or a crash) never sees half a file. The file gets the
umask's mode, as a plain `open(path, "w")` would."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: bytes) -> Path:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
