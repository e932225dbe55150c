"""Where a store's bytes live: one filesystem interface, a local and a remote implementation.

`open_fs(location)` gives `LocalFS` for a directory (or `file://`) and `RemoteFS` for any other
URL (`s3://`, `gs://`, `az://`, `hf://`, `memory://`, through that scheme's fsspec filesystem:
`pip install 'hookscope[s3]'`, `[gcs]`, `[azure]`, `[hf]`). The writer, reader, resume and the top
index use only the operations of `FS`: list, size, ranged read, map, atomic put, sha256, remove.

Locally a put writes `.tmp`, fsyncs and renames (then fsyncs the directory), and a reader maps
the file. Object stores have no atomic rename, so there an object is uploaded under its final
name (one PUT, or on S3 a multipart upload in parallel parts: whole or not at all; store/upload.py)
and its commit record is the commit point: a shard no manifest or record lists does not exist for
readers, and the next writer deletes it. Reading a URL uses ranged GETs (store/range_cache.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from ..atomic_files import fsync_dir, write_atomic
from ..errors import StoreError
from .checksum import checksum_of
from .upload import UploadSettings, upload_file

CHUNK = 1 << 22  # 4 MiB reads: large enough to read at disk speed, small enough to stay flat in memory

# the extra (pyproject.toml) behind each scheme, for the message when it is missing; hf:// needs none
# (huggingface_hub, which transformers installs, brings its filesystem)
_EXTRAS = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "az": "azure",
    "abfs": "azure",
    "abfss": "azure",
}


class Part(NamedTuple):
    """Bytes [start, end) of object `rel`."""

    rel: str
    start: int
    end: int


def sha256_of(f: BinaryIO) -> tuple[int, str]:
    """(bytes read, hex SHA-256) of what is left in the open binary file `f` (see `checksum_of`)."""
    return checksum_of(f, "sha256")


def is_remote(location: str | os.PathLike) -> bool:
    """True for a URL other than file://: the store lives on an fsspec filesystem."""
    text = os.fspath(location)
    return "://" in text and not text.startswith("file://")


def open_fs(location: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> FS:
    """The filesystem of a store at `location`: a local directory, `file://DIR`, or a URL."""
    if is_remote(location):
        return RemoteFS(os.fspath(location), storage_options)
    text = os.fspath(location)
    return LocalFS(text.removeprefix("file://") if text.startswith("file://") else text)


class FS:
    """The operations a store needs from where it lives, each naming the place in its errors.
    `url` is the store's location as one string (a directory or a URL); `rel` names are relative
    to it, with `/` separators. `remote` says reads go through ranged GETs (nothing to map)."""

    url: str
    remote: bool

    def __init__(self) -> None:
        self.bytes_read = self.requests = 0  # what reads have fetched, for tests and benchmarks
        self._stats_lock = threading.Lock()

    def __str__(self) -> str:
        return self.url

    def where(self, rel: str) -> str:
        return f"{self.url}/{rel}" if rel else self.url

    # -- reading ------------------------------------------------------------------------------

    def list(self, rel: str = "") -> list[str]:
        """Names (not paths) of everything directly under `rel`, sorted; [] if there is nothing."""
        raise NotImplementedError

    def sizes(self, rel: str = "") -> dict[str, int]:
        """Name -> bytes of the files directly under `rel` ({} if there are none)."""
        raise NotImplementedError

    def file_names(self, rel: str = "") -> set[str]:
        """Names of the files directly under `rel` (not directories), without their sizes."""
        return set(self.sizes(rel))

    def size(self, rel: str) -> int | None:
        """Bytes in file `rel`, None if there is no such file."""
        raise NotImplementedError

    def read(self, rel: str) -> bytes:
        """The whole of file `rel` (FileNotFoundError if there is none)."""
        try:
            data = self._whole(rel)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise StoreError(f"{self.where(rel)}: cannot read it ({e})") from e
        self._count(len(data), 1)
        return data

    def read_parts(self, parts: list[Part]) -> list[bytes | StoreError]:
        """Bytes [start, end) of each (file, start, end); a part that fails is a StoreError in its
        place, so one damaged file spoils no other."""
        raise NotImplementedError

    def read_ranges(self, rel: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """Byte ranges [start, end) of file `rel` (short where the file is shorter)."""
        datas = self.read_parts([Part(rel, start, end) for start, end in ranges])
        for data in datas:
            if isinstance(data, StoreError):
                raise data
        return datas  # type: ignore[return-value]

    def sha256(self, rel: str) -> tuple[int, str]:
        """(bytes, hex SHA-256) of file `rel`, streamed: nothing is kept."""
        return self.checksum(rel, "sha256")

    def checksum(self, rel: str, algorithm: str) -> tuple[int, str]:
        """(bytes, hex digest) of file `rel` by `algorithm` (store/checksum.py), streamed."""
        try:
            with self._open(rel) as f:
                size, digest = checksum_of(f, algorithm)
        except OSError as e:
            raise self._part_error(rel, e) from e
        self._count(size, 1)
        return size, digest

    def _whole(self, rel: str) -> bytes:
        raise NotImplementedError

    def _open(self, rel: str) -> BinaryIO:
        """File `rel` opened for reading from its start."""
        raise NotImplementedError

    def local(self, rel: str) -> Path | None:
        """The local file behind `rel`, to memory-map; None at a URL."""
        return None

    # -- writing ------------------------------------------------------------------------------

    def put(self, rel: str, data: bytes, *, durable: bool = True) -> None:
        """Replace file `rel` with `data` atomically (`durable`: synced to disk before it counts)."""
        raise NotImplementedError

    def put_file(self, local: Path, rel: str) -> None:
        """A finished, synced local file becomes `rel` (renamed, or uploaded and deleted)."""
        raise NotImplementedError

    def staging(self, rel: str, owner: str) -> Path:
        """A local directory of `owner`'s alone where files bound for directory `rel` are written
        first; the writer creates it when it writes (`rel` exists after this call). Everything
        in it is the owner's, a library's own temporary files included (safetensors writes a
        `.tmpXXXXXX` beside its target and renames it), so a crash's leftovers are found by name."""
        raise NotImplementedError

    def done_staging(self, staged: Path) -> None:
        """The writer is done with `staging()`'s directory: it goes, with anything left in it."""
        shutil.rmtree(staged, ignore_errors=True)

    def remove_stale_staging(self, owner: str, current: Path) -> None:
        """Delete the staging directories of `owner`'s crashed writers on this store, all but
        `current`; called with the store's lock held, so none of them belongs to a live writer. A
        local store's are inside the store, where the orphans' sweep finds them (orphans.py)."""

    def remove_tree(self, rel: str) -> None:
        """Delete `rel`, a file or everything under it (at a URL: every object under the prefix)."""
        self.remove(rel)

    def makedirs(self, rel: str) -> None:
        """Make directory `rel` (and those above it) where directories exist; an object store has none."""

    def remove(self, rel: str) -> None:
        """Delete file `rel` if it is there (or a directory a crashed writer left, with what it holds)."""
        raise NotImplementedError

    def _count(self, nbytes: int, requests: int) -> None:
        with self._stats_lock:
            self.bytes_read += nbytes
            self.requests += requests

    def _part_error(self, rel: str, error: BaseException) -> StoreError:
        if isinstance(error, FileNotFoundError):
            err = StoreError(f"{self.where(rel)}: listed in the manifest but missing")
        else:
            err = StoreError(
                f"{self.where(rel)}: cannot read it ({error}); if it is shorter than the "
                "manifest says, it was truncated or replaced"
            )
        err.__cause__ = error
        return err


class LocalFS(FS):
    """A store directory on the local disk."""

    remote = False

    def __init__(self, root: str | os.PathLike):
        super().__init__()
        self.root = Path(root)
        self.url = os.fspath(self.root)

    def local(self, rel: str) -> Path:
        return self.root / rel if rel else self.root

    def list(self, rel: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self.local(rel)))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise StoreError(f"{self.where(rel)}: cannot list it ({e})") from e

    def sizes(self, rel: str = "") -> dict[str, int]:
        out = {}
        try:
            with os.scandir(self.local(rel)) as found:
                for entry in found:
                    with contextlib.suppress(FileNotFoundError):  # renamed away since the listing
                        if entry.is_file():
                            out[entry.name] = entry.stat().st_size
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except OSError as e:
            raise StoreError(f"{self.where(rel)}: cannot list it ({e})") from e
        return out

    def file_names(self, rel: str = "") -> set[str]:
        try:
            with os.scandir(self.local(rel)) as found:  # the entry's type, from the listing: no stat
                return {entry.name for entry in found if entry.is_file()}
        except (FileNotFoundError, NotADirectoryError):
            return set()

    def size(self, rel: str) -> int | None:
        try:
            st = os.stat(self.local(rel))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise StoreError(f"{self.where(rel)}: cannot read it ({e})") from e
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def _whole(self, rel: str) -> bytes:
        return self.local(rel).read_bytes()

    def _open(self, rel: str) -> BinaryIO:
        return open(self.local(rel), "rb")

    def read_parts(self, parts: list[Part]) -> list[bytes | StoreError]:
        out: list[bytes | StoreError] = []
        for rel, start, end in parts:
            try:
                with open(self.local(rel), "rb") as f:
                    f.seek(start)
                    out.append(f.read(end - start))
            except OSError as e:
                out.append(self._part_error(rel, e))
        self._count(sum(len(d) for d in out if isinstance(d, bytes)), len(parts))
        return out

    def put(self, rel: str, data: bytes, *, durable: bool = True) -> None:
        write_atomic(self.local(rel), data, durable=durable)

    def put_file(self, local: Path, rel: str) -> None:
        final = self.local(rel)
        os.replace(local, final)
        fsync_dir(final.parent)

    def staging(self, rel: str, owner: str) -> Path:
        self.makedirs(rel)
        return self.local(rel) / owner  # inside `rel`: a rename out of it stays on one filesystem

    def makedirs(self, rel: str) -> None:
        self.local(rel).mkdir(parents=True, exist_ok=True)

    def remove(self, rel: str) -> None:
        path = self.local(rel)
        if path.is_dir() and not path.is_symlink():  # a crashed writer's staging directory
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


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
            hint = (
                f"pip install 'hookscope[{extra}]'" if extra else f"install fsspec's backend for {scheme}://"
            )
            raise StoreError(f"{url}: no filesystem for {scheme}:// is installed ({e}); {hint}") from e
        except ValueError as e:
            raise StoreError(f"{url}: not a store URL fsspec knows ({e})") from e
        self.url = url.rstrip("/")
        self.fs = fs
        self.root = root.rstrip("/")

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
        return {
            f["name"].rstrip("/").rsplit("/", 1)[-1]: int(f.get("size") or 0)
            for f in self._ls(rel)
            if f.get("type", "file") == "file"
        }

    def size(self, rel: str) -> int | None:
        try:
            info = (
                self.fs.info(self.path(rel), refresh=True)
                if _takes_refresh(self.fs)
                else self.fs.info(self.path(rel))
            )
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
            datas = self.fs.cat_ranges(
                [self.path(rel) for rel, _, _ in parts],
                [a for _, a, _ in parts],
                [b for _, _, b in parts],
                on_error="return",
            )
        except OSError as e:
            raise StoreError(f"{self.url}: cannot read {parts[0][0]} ({e})") from e
        out = [
            self._part_error(rel, d) if isinstance(d, BaseException) else d
            for (rel, _, _), d in zip(parts, datas, strict=True)
        ]
        self._count(sum(len(d) for d in out if isinstance(d, bytes)), len(parts))
        return out

    def put(self, rel: str, data: bytes, *, durable: bool = True) -> None:
        """One PUT: on an object store the object appears whole or not at all."""
        self.fs.pipe_file(self.path(rel), data)

    def put_file(self, local: Path, rel: str) -> None:
        """Uploaded under its final name, whole or not at all: on S3 in parallel parts (store/upload.py)."""
        upload_file(self.fs, local, self.path(rel), self.where(rel), UploadSettings.from_env())
        local.unlink()

    def staging(self, rel: str, owner: str) -> Path:
        return Path(
            tempfile.mkdtemp(prefix=self._staging_prefix(owner), dir=os.environ.get("HOOKSCOPE_STAGING_DIR"))
        )

    def remove_stale_staging(self, owner: str, current: Path) -> None:
        # a killed writer's directory stays in the machine's temporary directory (a shard or more
        # of it): found by this store's and this owner's name, and deleted
        for stale in current.parent.glob(self._staging_prefix(owner) + "*"):
            if stale != current and stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)

    def _staging_prefix(self, owner: str) -> str:
        # the store's URL in the name, so that writers of other stores on this machine are left alone
        store = hashlib.sha256(self.url.encode()).hexdigest()[:12]
        return f"hookscope-stage-{store}-{owner}-"

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
