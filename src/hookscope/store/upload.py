"""Shards on their way to an object store, uploaded while the next ones are cut and computed.

The writer hands `Uploads.submit` a finished local shard, its final name and the commit that makes
it part of the store, and goes on with the next shard. Each shard is uploaded under its final name
(`upload_file`: on S3 a multipart upload of `part_bytes` parts, several at once, each part retried;
elsewhere the filesystem's own `put_file`), and its commit runs once its object exists AND every
shard submitted before it has committed: the store's commits keep the order the shards were cut,
and no shard is committed before all its bytes are stored. At most `in_flight` shards are uploading
or waiting for their commit (`submit` blocks beyond that), and at most `threads` parts are in memory
at once, so the staged files and the parts held stay bounded however long the run.

A failed upload is a StoreError naming the shard's URL; no shard after it commits (their objects are
deleted), so the store keeps an unbroken run of shards and the resume redoes the rest. A multipart
upload that fails is aborted; one a killed process left behind (invisible to readers, but kept and
billed on S3) is aborted when the resumed run uploads that shard again (`abort_unfinished`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import StoreError

_DONE = object()


def _env_int(name: str, default: int, least: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise StoreError(f"${name}={text!r}: give a whole number >= {least} (default {default})")
    return value


@dataclass(frozen=True)
class UploadSettings:
    """How shards go up: `part_bytes` a part (S3 wants >= 5 MiB but the last), `threads` parts at
    once, `in_flight` shards uploading or awaiting their commit, `retries` more tries of a part."""

    part_bytes: int = 100 << 20  # Activault's part size: few requests, a part's loss cheap to redo
    threads: int = 4
    in_flight: int = 2
    retries: int = 3

    @classmethod
    def from_env(cls) -> UploadSettings:
        d = cls()
        return cls(part_bytes=_env_int("HOOKSCOPE_UPLOAD_PART_BYTES", d.part_bytes, 1),
                   threads=_env_int("HOOKSCOPE_UPLOAD_THREADS", d.threads, 1),
                   in_flight=_env_int("HOOKSCOPE_UPLOADS_IN_FLIGHT", d.in_flight, 1),
                   retries=_env_int("HOOKSCOPE_UPLOAD_RETRIES", d.retries, 0))


class UploadFailed(StoreError):
    """One shard's upload failed (after its retries); the message names the shard's URL."""


def _is_s3(fs: Any) -> bool:
    return hasattr(fs, "call_s3")


def _retried(fn: Callable[[], Any], retries: int) -> Any:
    """`fn()`, tried again up to `retries` times after a failure that another try may mend."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except (PermissionError, FileNotFoundError, IsADirectoryError):
            raise  # credentials, a missing bucket or an aborted upload: no try mends them
        except Exception:  # noqa: BLE001 - a dropped connection, a throttle, a server's 5xx
            if attempt == retries:
                raise
            time.sleep(min(0.2 * 2**attempt, 5))
    raise AssertionError("unreachable")


def put_part(fs: Any, fd: int, bucket: str, key: str, upload_id: str, number: int, start: int, end: int,
             retries: int) -> str:
    """Upload bytes [start, end) of open file `fd` as part `number`; its ETag."""
    data = os.pread(fd, end - start, start)
    return _retried(lambda: fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload_id,
                                       PartNumber=number, Body=data)["ETag"], retries)


def _put_whole(fs: Any, local: Path, path: str, retries: int) -> None:
    if _is_s3(fs):  # one PUT from a buffer of our own: s3fs's put_file would use its own parts
        bucket, key, _ = fs.split_path(path)
        data = local.read_bytes()
        _retried(lambda: fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data), retries)
    else:
        _retried(lambda: fs.put_file(str(local), path), retries)


def abort_unfinished(fs: Any, path: str) -> None:
    """Abort the multipart uploads of object `path` still open on S3 (a killed run's, never to be
    finished). Best effort: a key allowed to put objects but not to list uploads loses nothing."""
    if not _is_s3(fs):
        return
    bucket, key, _ = fs.split_path(path)
    with contextlib.suppress(Exception):
        listed = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key)
        for upload in listed.get("Uploads") or []:
            if upload["Key"] == key:
                fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload["UploadId"])


def upload_file(fs: Any, local: Path, path: str, where: str, settings: UploadSettings,
                parts: ThreadPoolExecutor) -> None:
    """Local file `local` becomes object `path` of fsspec filesystem `fs`, whole or not at all: on
    S3 in parts of `settings.part_bytes` run by `parts` (aborted if one fails for good). `where`
    names it in errors."""
    size = local.stat().st_size
    try:
        abort_unfinished(fs, path)
        if not _is_s3(fs) or size <= settings.part_bytes:
            # in the part pool too: the bytes held at once stay bounded
            parts.submit(_put_whole, fs, local, path, settings.retries).result()
        else:
            _put_in_parts(fs, local, path, size, settings, parts)
    except Exception as e:
        raise UploadFailed(f"{where}: uploading this shard ({size:,} bytes) failed ({e!r}), after up to "
                           f"{settings.retries} retries of each request; the shards committed before it "
                           "are intact. Fix the cause (connection, credentials, bucket) and re-run the "
                           "same command to resume") from e
    fs.invalidate_cache(path)


def _put_in_parts(fs: Any, local: Path, path: str, size: int, settings: UploadSettings,
                  parts: ThreadPoolExecutor) -> None:
    bucket, key, _ = fs.split_path(path)
    upload_id = _retried(lambda: fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key),
                         settings.retries)["UploadId"]
    step = settings.part_bytes
    with open(local, "rb") as f:  # open until no part reads it any more
        futures = [parts.submit(put_part, fs, f.fileno(), bucket, key, upload_id, n + 1, start,
                                min(start + step, size), settings.retries)
                   for n, start in enumerate(range(0, size, step))]
        try:
            etags = [future.result() for future in futures]  # the first failure ends the wait
            done = {"Parts": [{"PartNumber": n + 1, "ETag": etag} for n, etag in enumerate(etags)]}
            _retried(lambda: fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key,
                                        UploadId=upload_id, MultipartUpload=done), settings.retries)
        except BaseException:
            for future in futures:
                if not future.cancel():
                    future.exception()  # wait for a running part: it reads the file
            with contextlib.suppress(Exception):  # else a stored, billed, invisible upload stays behind
                fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            raise


class Uploads:
    """A remote filesystem's uploads: the pool of part threads, and the shards of its writer on their
    way up, uploaded by `put(local, rel)` in background threads and committed in the order submitted,
    each only once its own upload has completed. Threads start at the first use; `settle` ends them."""

    def __init__(self, put: Callable[[Path, str], None], remove: Callable[[str], None]):
        self._put, self._remove = put, remove
        self._settings: UploadSettings | None = None
        self._parts: ThreadPoolExecutor | None = None
        self._shards: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @property
    def settings(self) -> UploadSettings:
        if self._settings is None:  # read when first needed: a store only read never checks them
            self._settings = UploadSettings.from_env()
        return self._settings

    def upload(self, fs: Any, local: Path, path: str, where: str) -> None:
        """`upload_file` with these settings and part threads."""
        with self._lock:
            if self._parts is None:
                self._parts = ThreadPoolExecutor(self.settings.threads, thread_name_prefix="hookscope-part")
            parts = self._parts
        upload_file(fs, local, path, where, self.settings, parts)

    def submit(self, local: Path, rel: str, commit: Callable[[], None]) -> None:
        """Upload `local` as `rel` (the file is deleted after), then `commit()` once it and every
        shard before it are in place. Blocks while `in_flight` shards are pending; raises the first
        failure of any earlier shard (and then deletes `local`, which will not be uploaded)."""
        if self._shards is None:
            self._slots = threading.Semaphore(self.settings.in_flight)
            self._order: queue.Queue = queue.Queue()  # (upload's future, local, rel, commit), in order
            self._error: BaseException | None = None
            self._shards = ThreadPoolExecutor(self.settings.in_flight, thread_name_prefix="hookscope-upload")
            self._committer = threading.Thread(target=self._commit_in_order, name="hookscope-upload-commit",
                                               daemon=True)
            self._committer.start()
        self._slots.acquire()
        if self._error is not None:
            self._slots.release()
            local.unlink(missing_ok=True)
            raise self._error
        self._order.put((self._shards.submit(self._put, local, rel), local, rel, commit))

    def settle(self) -> None:
        """Wait for every submitted shard to be committed (or refused), stop the threads, and raise
        the first failure."""
        error = None
        if self._shards is not None:
            self._order.put(_DONE)
            self._committer.join()
            self._shards.shutdown()
            self._shards, error = None, self._error
        with self._lock:
            if self._parts is not None:
                self._parts.shutdown()
                self._parts = None
        if error is not None:
            raise error

    def _commit_in_order(self) -> None:
        while (item := self._order.get()) is not _DONE:
            future, local, rel, commit = item
            try:
                if self._error is not None:
                    if not future.cancel():
                        future.exception()  # wait: it may still be storing the object deleted below
                    raise self._error
                future.result()
                commit()
            except BaseException as e:  # noqa: BLE001 - handed to the writer at its next submit / settle
                if self._error is None:
                    self._error = e
                local.unlink(missing_ok=True)
                with contextlib.suppress(Exception):  # an object no one will commit: free its space now
                    self._remove(rel)
            finally:
                self._slots.release()
