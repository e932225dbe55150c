"""A store at a URL: `RemoteFS`, the `FS` operations (store/fs.py) over an fsspec filesystem.

Object stores have no atomic rename and no append: an object is uploaded under its final name (one
PUT, or one multipart upload: whole or not at all), and a manifest or commit record object is the
commit point (store/journal.py).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import StoreError
from .fs import _EXTRAS, CHUNK, FS, Part


class RemoteFS(FS):
    """A store directory on an fsspec filesystem."""

    remote = True

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        super().__init__()
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

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def _ls(self, rel: str) -> list[dict[str, Any]]:
        try:
            return self.fs.ls(self.path(rel), detail=True, refresh=True)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StoreError(f"{self.url}: cannot list {rel or 'the store'} ({e})") from e

    def list(self, rel: str = "") -> list[str]:
        return sorted(f["name"].rstrip("/").rsplit("/", 1)[-1] for f in self._ls(rel))

    def sizes(self, rel: str = "") -> dict[str, int]:
        return {f["name"].rstrip("/").rsplit("/", 1)[-1]: int(f.get("size") or 0)
                for f in self._ls(rel) if f.get("type", "file") == "file"}

    def size(self, rel: str) -> int | None:
        try:
            info = self.fs.info(self.path(rel), refresh=True) if _takes_refresh(self.fs) \
                else self.fs.info(self.path(rel))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"{self.where(rel)}: cannot read it ({e})") from e
        return int(info["size"]) if info.get("type", "file") == "file" else None

    def _whole(self, rel: str) -> bytes:
        return self.fs.cat_file(self.path(rel))

    def _open(self, rel: str) -> BinaryIO:
        return self.fs.open(self.path(rel), "rb", block_size=CHUNK)

    def read_parts(self, parts: list[Part]) -> list[bytes | StoreError]:
        """One concurrent batch of ranged GETs, where the filesystem is asynchronous (s3fs, gcsfs,
        adlfs)."""
        if not parts:
            return []
        try:
            datas = self.fs.cat_ranges([self.path(rel) for rel, _, _ in parts], [a for _, a, _ in parts],
                                       [b for _, _, b in parts], on_error="return")
        except OSError as e:
            raise StoreError(f"{self.url}: cannot read {parts[0][0]} ({e})") from e
        out = [self._part_error(rel, d) if isinstance(d, BaseException) else d
               for (rel, _, _), d in zip(parts, datas, strict=True)]
        self._count(sum(len(d) for d in out if isinstance(d, bytes)), len(parts))
        return out

    def read_many(self, rels: list[str]) -> list[bytes | None]:
        if not rels:
            return []
        try:
            got = self.fs.cat([self.path(rel) for rel in rels], on_error="return")
        except OSError as e:
            raise StoreError(f"{self.url}: cannot read {rels[0]} ({e})") from e
        out: list[bytes | None] = []
        for rel in rels:
            data = got.get(self.path(rel), FileNotFoundError()) if isinstance(got, dict) else got
            if isinstance(data, FileNotFoundError):
                out.append(None)
            elif isinstance(data, BaseException):
                raise StoreError(f"{self.where(rel)}: cannot read it ({data})") from data
            else:
                out.append(data)
                self._count(len(data), 1)
        return out

    def put(self, rel: str, data: bytes, *, durable: bool = True) -> None:
        """One PUT: on an object store the object appears whole or not at all."""
        self.fs.pipe_file(self.path(rel), data)

    def put_file(self, local: Path, rel: str) -> None:
        self.fs.put_file(str(local), self.path(rel))
        local.unlink()

    def staging(self, rel: str, owner: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"hookscope-stage-{owner}-",
                                     dir=os.environ.get("HOOKSCOPE_STAGING_DIR")))

    def remove(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(rel))

    def remove_tree(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(rel), recursive=True)


def _takes_refresh(fs: Any) -> bool:
    import inspect

    try:
        return "refresh" in inspect.signature(fs.info).parameters
    except (TypeError, ValueError):
        return False
