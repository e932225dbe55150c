"""A shard put at a URL: whole or not at all, on S3 in parallel multipart parts.

The writer's commit thread uploads each finished shard (`RemoteFS.put_file`) while the writer cuts
the next one, and commits it once its object exists (store/writer.py). On S3 a shard larger than a
part is a multipart upload of `part_bytes` parts, `threads` at once (so at most `threads` parts
in memory), each request tried again `retries` times; elsewhere the filesystem's own `put_file`.

An upload that fails for good is a StoreError naming the shard's URL, and its multipart upload is
aborted. One a killed process left behind (invisible to readers, but kept and billed on S3) is
aborted when the resumed run uploads that shard again (`abort_unfinished`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import StoreError


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
    once, `retries` more tries of a request."""

    part_bytes: int = 100 << 20  # Activault's part size: few requests, a part's loss cheap to redo
    threads: int = 4
    retries: int = 3

    @classmethod
    def from_env(cls) -> UploadSettings:
        d = cls()
        return cls(
            part_bytes=_env_int("HOOKSCOPE_UPLOAD_PART_BYTES", d.part_bytes, 1),
            threads=_env_int("HOOKSCOPE_UPLOAD_THREADS", d.threads, 1),
            retries=_env_int("HOOKSCOPE_UPLOAD_RETRIES", d.retries, 0),
        )


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


def put_part(
    fs: Any, fd: int, bucket: str, key: str, upload_id: str, number: int, start: int, end: int, retries: int
) -> str:
    """Upload bytes [start, end) of open file `fd` as part `number`; its ETag."""
    data = os.pread(fd, end - start, start)
    return _retried(
        lambda: fs.call_s3(
            "upload_part", Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data
        )["ETag"],
        retries,
    )


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


def upload_file(fs: Any, local: Path, path: str, where: str, settings: UploadSettings) -> None:
    """Local file `local` becomes object `path` of fsspec filesystem `fs`, whole or not at all: on
    S3 in parts of `settings.part_bytes`, `settings.threads` at once (aborted if one fails for
    good). `where` names it in errors."""
    size = local.stat().st_size
    try:
        abort_unfinished(fs, path)
        if not _is_s3(fs) or size <= settings.part_bytes:
            _put_whole(fs, local, path, settings.retries)
        else:
            with ThreadPoolExecutor(settings.threads, thread_name_prefix="hookscope-part") as parts:
                _put_in_parts(fs, local, path, size, settings, parts)
    except Exception as e:
        raise StoreError(
            f"{where}: uploading this shard ({size:,} bytes) failed ({e!r}), after up to "
            f"{settings.retries} retries of each request; the shards committed before it "
            "are intact. Fix the cause (connection, credentials, bucket) and re-run the "
            "same command to resume"
        ) from e
    fs.invalidate_cache(path)


def _put_in_parts(
    fs: Any, local: Path, path: str, size: int, settings: UploadSettings, parts: ThreadPoolExecutor
) -> None:
    bucket, key, _ = fs.split_path(path)
    upload_id = _retried(
        lambda: fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key), settings.retries
    )["UploadId"]
    step = settings.part_bytes
    with open(local, "rb") as f:  # open until no part reads it any more
        futures = [
            parts.submit(
                put_part,
                fs,
                f.fileno(),
                bucket,
                key,
                upload_id,
                n + 1,
                start,
                min(start + step, size),
                settings.retries,
            )
            for n, start in enumerate(range(0, size, step))
        ]
        try:
            etags = [future.result() for future in futures]  # the first failure ends the wait
            done = {"Parts": [{"PartNumber": n + 1, "ETag": etag} for n, etag in enumerate(etags)]}
            _retried(
                lambda: fs.call_s3(
                    "complete_multipart_upload",
                    Bucket=bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload=done,
                ),
                settings.retries,
            )
        except BaseException:
            for future in futures:
                if not future.cancel():
                    future.exception()  # wait for a running part: it reads the file
            with contextlib.suppress(Exception):  # else a stored, billed, invisible upload stays behind
                fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            raise
