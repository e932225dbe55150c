"""Where a store's bytes live: a local directory, or a URL on an fsspec filesystem.

A local path (or `file://`) keeps the POSIX path the writer and reader always had: write `.tmp`,
fsync, rename, fsync the directory. Any other URL (`s3://`, `gs://`, `az://`, `hf://`,
`memory://`) goes through that scheme's fsspec filesystem (`pip install 'hookscope[s3]'`, `[gcs]`,
`[azure]`, `[hf]`). Object stores have no atomic rename, so there a shard object is uploaded under
its final name first and the manifest object, written in one PUT, is the commit point: a shard
that the manifest does not list does not exist for readers, and the next writer deletes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import StoreError

CHUNK = 1 << 22  # 4 MiB reads: large enough to hash at disk speed, small enough to stay flat in memory

# the optional package behind each scheme, for the message when it is missing
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure",
           "abfss": "azure", "hf": "hf"}


def sha256_of(f: BinaryIO) -> tuple[int, str]:
    """(bytes read, hex SHA-256) of what is left in the open binary file `f`."""
    h = hashlib.sha256()
    size = 0
    while chunk := f.read(CHUNK):
        h.update(chunk)
        size += len(chunk)
    return size, h.hexdigest()


def is_remote(name: str | os.PathLike) -> bool:
    """True for a URL other than file://: the store lives on an fsspec filesystem."""
    text = os.fspath(name)
    return "://" in text and not text.startswith("file://")


def local_path(name: str | os.PathLike) -> Path:
    text = os.fspath(name)
    return Path(text.removeprefix("file://")) if text.startswith("file://") else Path(text)


class Remote:
    """A store directory on an fsspec filesystem: the few operations the writer and reader need,
    each naming the URL in its error."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        try:
            import fsspec
        except ImportError as e:  # pragma: no cover - fsspec comes with torch's own dependencies
            raise StoreError(f"{url}: URLs need the fsspec package: pip install fsspec") from e
        scheme = url.split("://", 1)[0]
        try:
            fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        except ImportError as e:
            extra = _EXTRAS.get(scheme)
            hint = f"pip install 'hookscope[{extra}]'" if extra else f"install fsspec's backend for {scheme}://"
            raise StoreError(f"{url}: no filesystem for {scheme}:// is installed ({e}); {hint}") from e
        except ValueError as e:
            raise StoreError(f"{url}: not a store URL fsspec knows ({e})") from e
        self.url, self.fs, self.root = url.rstrip("/"), fs, root.rstrip("/")

    def __str__(self) -> str:
        return self.url

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def list(self, rel: str = "") -> list[str]:
        """Names (not paths) of the objects directly under `rel`; [] if there are none."""
        try:
            found = self.fs.ls(self.path(rel), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StoreError(f"{self.url}: cannot list {rel or 'the store'} ({e})") from e
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in found)

    def read(self, rel: str) -> bytes:
        try:
            return self.fs.cat_file(self.path(rel))
        except FileNotFoundError:
            raise
        except OSError as e:
            raise StoreError(f"{self.url}/{rel}: cannot read it ({e})") from e

    def size(self, rel: str) -> int | None:
        """Bytes in object `rel`, None if there is no such object."""
        try:
            info = self.fs.info(self.path(rel), refresh=True) if _takes_refresh(self.fs) \
                else self.fs.info(self.path(rel))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"{self.url}/{rel}: cannot read it ({e})") from e
        return int(info["size"]) if info.get("type", "file") == "file" else None

    def write(self, rel: str, data: bytes) -> None:
        """One PUT: on an object store the object appears whole or not at all."""
        self.fs.pipe_file(self.path(rel), data)

    def upload(self, local: Path, rel: str) -> None:
        self.fs.put_file(str(local), self.path(rel))

    def download(self, rel: str, local: Path) -> None:
        self.fs.get_file(self.path(rel), str(local))

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(rel))


def _takes_refresh(fs: Any) -> bool:
    import inspect

    try:
        return "refresh" in inspect.signature(fs.info).parameters
    except (TypeError, ValueError):
        return False


class ShardCache:
    """Remote shards copied to a local directory (bounded by bytes, least recently used evicted) so
    that safetensors can memory-map them; `prefetch` starts a copy in the background."""

    def __init__(self, remote: Remote, max_bytes: int | None = None, directory: str | None = None):
        self.remote = remote
        self.max_bytes = max_bytes if max_bytes is not None else int(
            os.environ.get("HOOKSCOPE_CACHE_BYTES", 8 << 30))
        base = directory or os.environ.get("HOOKSCOPE_CACHE_DIR")
        self.dir = Path(tempfile.mkdtemp(prefix="hookscope-cache-", dir=base))
        self._files: OrderedDict[str, int] = OrderedDict()  # rel -> bytes, oldest first
        self._pending: dict[str, threading.Thread] = {}
        self._errors: dict[str, BaseException] = {}
        self._lock = threading.Lock()

    def get(self, rel: str) -> Path:
        """The local copy of object `rel` (downloaded now, or waited for if being prefetched)."""
        with self._lock:
            thread = self._pending.get(rel)
        if thread is not None:
            thread.join()
        with self._lock:
            if rel in self._errors:
                raise self._errors.pop(rel)
            if rel in self._files:
                self._files.move_to_end(rel)
                return self._local(rel)
        self._fetch(rel)
        return self._local(rel)

    def prefetch(self, rel: str) -> None:
        with self._lock:
            if rel in self._files or rel in self._pending:
                return
            thread = threading.Thread(target=self._fetch_quietly, args=(rel,), daemon=True,
                                      name="hookscope-prefetch")
            self._pending[rel] = thread
        thread.start()

    def close(self) -> None:
        for thread in list(self._pending.values()):
            thread.join()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _local(self, rel: str) -> Path:
        return self.dir / rel.replace("/", "__")

    def _fetch_quietly(self, rel: str) -> None:
        try:
            self._fetch(rel)
        except BaseException as e:  # noqa: BLE001 - handed to the caller at get()
            with self._lock:
                self._errors[rel] = e
        finally:
            with self._lock:
                self._pending.pop(rel, None)

    def _fetch(self, rel: str) -> None:
        local = self._local(rel)
        tmp = local.with_name(local.name + f".{threading.get_ident()}.part")
        try:
            self.remote.download(rel, tmp)
        except FileNotFoundError:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"{self.remote.url}/{rel}: listed in the manifest but missing") from None
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise StoreError(f"{self.remote.url}/{rel}: cannot download it ({e})") from e
        size = tmp.stat().st_size
        os.replace(tmp, local)
        with self._lock:
            self._files[rel] = size
            self._files.move_to_end(rel)
            while sum(self._files.values()) > self.max_bytes and len(self._files) > 1:
                old, _ = self._files.popitem(last=False)
                self._local(old).unlink(missing_ok=True)  # an mmap of it stays valid until dropped
