"""Shards at a URL go up while the next one is cut, on S3 in parallel multipart parts
(store/upload.py), against moto's S3 server (the `s3` fixture of test_store_s3.py). Each test
compares the objects with the files a local store of the same batches holds: the parts cover each
shard exactly, the next shard is cut while one uploads, a shard commits only after its upload and
before the next goes up, one shard uploads at a time (and the caller is held back), a failed part is
retried, and a part that keeps failing is a StoreError naming the shard's URL after which nothing
commits; the rerun resumes."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from gate import need

need("s3")

import s3fs  # noqa: E402
from test_store_s3 import bucket, local_objects, open_uploads, s3, s3_objects  # noqa: E402, F401 - fixtures

from hookscope.errors import StoreError  # noqa: E402
from hookscope.store import ShardWriter, open_store  # noqa: E402
from hookscope.store import fs as fs_module  # noqa: E402
from hookscope.store import upload as upload_module  # noqa: E402
from hookscope.store.fs import open_fs  # noqa: E402
from hookscope.store.journal import load_manifest  # noqa: E402

SETTINGS = {"test": "upload"}
ROWS, WIDTH, BATCHES = 64, 192, 10  # a batch a shard: 24 KiB of float16 + 2 KiB of meta, in 4 parts
PART = 8192
SHARD = "shards/shard-r000-{:06d}.safetensors"


def batch(i: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(i)).half()
    ids = torch.arange(i * ROWS, (i + 1) * ROWS)
    return {"blocks.0.resid_post": x}, {
        "token_ids": ids,
        "doc_ids": ids // 50,
        "positions": ids % 50,
        "seq_ids": ids // 32,
    }


def write(location) -> None:
    with ShardWriter(location, SETTINGS, shard_rows=ROWS) as writer:
        for i in range(BATCHES):
            if writer.owns(i):
                writer.write(i, *batch(i))


def committed(url: str) -> list[str]:
    """The shards committed to the store at `url` right now (its manifest and journal)."""
    return [s.file for s in load_manifest(open_fs(url), "manifest.json").shards]


@pytest.fixture(autouse=True)
def small_parts(monkeypatch, tmp_path):
    monkeypatch.setenv("HOOKSCOPE_UPLOAD_PART_BYTES", str(PART))
    monkeypatch.setenv("HOOKSCOPE_STAGING_DIR", str(tmp_path))


@pytest.fixture
def local(tmp_path):
    """The same batches in a local directory: the bytes every object must have."""
    write(tmp_path / "local")
    return tmp_path / "local"


@pytest.fixture
def url(bucket) -> str:  # noqa: F811
    return f"s3://{bucket}/store"


@pytest.mark.slow
def test_shards_go_up_in_parts_that_cover_them_exactly(s3, bucket, url, local, monkeypatch):  # noqa: F811
    parts, real = [], upload_module.put_part

    def counted(fs, fd, bucket, key, upload_id, number, start, end, retries):
        parts.append((key.rsplit("/", 1)[-1], number, start, end))
        return real(fs, fd, bucket, key, upload_id, number, start, end, retries)

    monkeypatch.setattr(upload_module, "put_part", counted)
    write(url)
    assert s3_objects(s3, url) == local_objects(local)
    for i in range(BATCHES):
        name = SHARD.format(i)
        size = (local / name).stat().st_size
        got = sorted((n, a, b) for shard, n, a, b in parts if f"shards/{shard}" == name)
        assert got == [(k + 1, a, min(a + PART, size)) for k, a in enumerate(range(0, size, PART))]
        assert len(got) >= 3
    assert open_uploads(s3, bucket) == []


def staged(tmp_path, i: int) -> bool:
    """Whether shard `i` has been cut: its file written in the writer's local staging directory."""
    return any(tmp_path.glob(f"hookscope-stage-*/{SHARD.format(i).removeprefix('shards/')}.tmp"))


@pytest.mark.slow
def test_the_next_shard_is_cut_while_one_uploads_and_commits_follow_their_uploads(
    s3,  # noqa: F811
    url,
    local,  # noqa: F811
    monkeypatch,
    tmp_path,
):
    """The first shard's upload waits until the second shard is cut: a writer that uploads before it
    takes the next batch never gets there; the second goes up only once the first is committed."""
    seen, real = {}, fs_module.RemoteFS.put_file

    def put_file(self, path, rel):
        if rel == SHARD.format(0):
            deadline = time.monotonic() + 30
            while not staged(tmp_path, 1) and time.monotonic() < deadline:
                time.sleep(0.02)
            seen["cut while uploading"] = staged(tmp_path, 1)
            seen["committed before the upload"] = committed(url)
        if rel == SHARD.format(1):
            seen["committed when the next goes up"] = committed(url)
        real(self, path, rel)

    monkeypatch.setattr(fs_module.RemoteFS, "put_file", put_file)
    write(url)
    assert seen == {
        "cut while uploading": True,
        "committed before the upload": [],
        "committed when the next goes up": [SHARD.format(0)],
    }
    assert s3_objects(s3, url) == local_objects(local)


@pytest.mark.slow
def test_one_shard_uploads_at_a_time_and_the_caller_is_held_back(
    s3,  # noqa: F811
    url,
    local,
    monkeypatch,  # noqa: F811
    tmp_path,
):
    release, started, fed, real = threading.Event(), [], [], fs_module.RemoteFS.put_file

    def put_file(self, path, rel):
        started.append(rel)
        release.wait(60)
        real(self, path, rel)

    def feed():
        with ShardWriter(url, SETTINGS, shard_rows=ROWS) as writer:
            for i in range(BATCHES):
                writer.write(i, *batch(i))
                fed.append(i)

    monkeypatch.setattr(fs_module.RemoteFS, "put_file", put_file)
    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        deadline = time.monotonic() + 30
        while len(fed) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # a writer without a bound would go on meanwhile
        # one upload; the next shard cut and waiting for its commit; 4 batches queued; the caller
        # blocked on the next: memory and staged files stay bounded
        assert (len(started), len(fed)) == (1, 6)
        assert len(list(tmp_path.glob("hookscope-stage-*/*.tmp"))) == 2
    finally:
        release.set()
        feeder.join(60)
    assert s3_objects(s3, url) == local_objects(local)


@pytest.mark.slow
def test_a_failed_part_is_retried(s3, bucket, url, local, monkeypatch):  # noqa: F811
    fails, real = [], s3fs.S3FileSystem.call_s3

    def flaky(self, method, *args, **kwargs):
        if (
            method == "upload_part"
            and kwargs["Key"].endswith(SHARD.format(1))
            and kwargs["PartNumber"] == 2
            and len(fails) < 2
        ):
            fails.append(kwargs["PartNumber"])
            raise ConnectionResetError("connection reset (by the test)")
        return real(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "call_s3", flaky)
    write(url)
    assert fails == [2, 2]
    assert s3_objects(s3, url) == local_objects(local)
    assert open_uploads(s3, bucket) == []


@pytest.mark.slow
def test_a_part_that_keeps_failing_commits_nothing_after_it_and_the_rerun_resumes(
    s3,  # noqa: F811
    bucket,  # noqa: F811
    url,
    local,  # noqa: F811
    monkeypatch,
):
    monkeypatch.setenv("HOOKSCOPE_UPLOAD_RETRIES", "2")
    tries, real = [], s3fs.S3FileSystem.call_s3

    def broken(self, method, *args, **kwargs):
        if method == "upload_part" and kwargs["Key"].endswith(SHARD.format(2)) and kwargs["PartNumber"] == 2:
            tries.append(method)
            raise ConnectionResetError("connection reset (by the test)")
        return real(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "call_s3", broken)
    with pytest.raises(StoreError, match=f"{url}/{SHARD.format(2)}: uploading this shard"):
        write(url)
    assert len(tries) == 3  # the first try and 2 retries
    assert committed(url) == [SHARD.format(0), SHARD.format(1)]
    # the third shard's upload aborted, and the fourth, uploaded meanwhile, deleted: no object left
    # that no manifest lists, no upload left open
    assert {k for k in s3_objects(s3, url) if k.startswith("shards/")} == {SHARD.format(0), SHARD.format(1)}
    assert open_uploads(s3, bucket) == []
    assert len(open_store(url, verify=True)) == 2 * ROWS
    monkeypatch.setattr(s3fs.S3FileSystem, "call_s3", real)
    write(url)  # the same run again: resumes from the third shard
    assert s3_objects(s3, url) == local_objects(local)
