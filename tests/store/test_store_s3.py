"""Stores at a URL, against a real S3-compatible server on 127.0.0.1 (moto's standalone server,
started and stopped here): extraction equals the local store byte for byte, SIGKILL / SIGINT and
resume, orphans, hostile objects, two ranks with torchrun's environment writing to one URL, and
elastic resumes (started by 2 processes and finished by 1, and 1 -> 2).

Skipped when `moto[server]` and `s3fs` are not installed (`pip install 'hookscope[s3-test]'`)."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gate import need

need("s3")

from elastic_kit import assert_same_rows_as, run_elastic, run_ranks  # noqa: E402
from faultkit import damage  # noqa: E402
from forkserver import ForkServer  # noqa: E402
from helpers import corpus_fixture, extract_cli_args  # noqa: E402

from hookscope.cli import main  # noqa: E402
from hookscope.errors import StoreError  # noqa: E402
from hookscope.store import open_store  # noqa: E402

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
MIN_PART = 1024  # the smallest multipart part the test server takes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """An S3 server on a free loopback port for this module; its endpoint set for s3fs (botocore
    reads AWS_ENDPOINT_URL) in this process and in every child."""
    port = _free_port()
    log = tmp_path_factory.mktemp("moto") / "server.log"
    with open(log, "wb") as out:
        # parts as small as the tests' (S3 itself takes no part but the last under 5 MiB)
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "S3_UPLOAD_PART_MIN_SIZE": str(MIN_PART)},
        )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"the moto server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.2)
    saved = {k: os.environ.get(k) for k in [*CREDENTIALS, "AWS_ENDPOINT_URL"]}
    os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=endpoint)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield s3fs.S3FileSystem()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        s3fs.S3FileSystem.clear_instance_cache()
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()


_buckets = iter(range(10**6))


@pytest.fixture
def bucket(s3) -> str:
    name = f"hookscope-{os.getpid()}-{next(_buckets)}"
    s3.mkdir(name)
    return name


corpus = corpus_fixture(30)
cli_args = extract_cli_args


@pytest.fixture(scope="module")
def reference(tiny_dirs, corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "store"
    assert main(cli_args(tiny_dirs["gpt2"], corpus, str(out))) == 0
    return out


def local_objects(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def s3_objects(s3, url: str) -> dict[str, str]:
    root = url.removeprefix("s3://")
    s3.invalidate_cache()
    return {
        p.removeprefix(root + "/"): hashlib.sha256(s3.cat_file(p)).hexdigest() for p in sorted(s3.find(root))
    }


@pytest.fixture(scope="module")
def server(tiny_dirs) -> ForkServer:
    """The killed runs are children of the fork server (tests/kit/forkserver.py): real processes,
    without a Python start-up each."""
    server = ForkServer.shared()
    server.warm("faultkit:load_model", path=str(tiny_dirs["gpt2"]))
    return server


def endpoint() -> dict[str, str]:
    """What a fork-server child needs to reach this module's S3 server (and the part size a test
    set): the server's environment was fixed when it started."""
    names = [*CREDENTIALS, "AWS_ENDPOINT_URL", "HOOKSCOPE_UPLOAD_PART_BYTES"]
    return {k: os.environ[k] for k in names if k in os.environ}


@pytest.mark.slow
def test_extract_to_s3_equals_the_local_store(s3, bucket, tiny_dirs, corpus, reference, capsys):
    url = f"s3://{bucket}/run/store"
    assert main(cli_args(tiny_dirs["gpt2"], corpus, url)) == 0
    assert s3_objects(s3, url) == local_objects(reference)  # every object byte for byte, nothing else
    remote, local = open_store(url, verify=True), open_store(reference)
    assert len(remote) == len(local) > 0 and remote.num_shards == local.num_shards > 3
    for name in local.manifest.columns:
        assert torch.equal(remote.tensor(name), local.tensor(name))
    # the shuffled dataset reads a URL unchanged: the same rows in the same order as locally
    got = [r.clone() for r in remote.dataset("blocks.1.resid_post", seed=3, buffer_rows=300)][:400]
    want = list(local.dataset("blocks.1.resid_post", seed=3, buffer_rows=300))[:400]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    capsys.readouterr()
    assert main(["inspect", url]) == 0
    assert "verified" in capsys.readouterr().out


# the moments a URL store adds (upload, put) by default; the ones a local store shares with it
# (tests/faults/test_faults_kill.py, test_faults_signals.py run those locally) with --full
LOCAL_TOO = pytest.mark.full


@pytest.mark.parametrize(
    ("sig", "at"),
    [
        pytest.param("KILL", "batch:4", marks=LOCAL_TOO),
        pytest.param("KILL", "save:2", marks=LOCAL_TOO),
        ("KILL", "upload:3:after"),
        ("KILL", "upload:2:before"),
        ("KILL", "put:4:before"),
        ("KILL", "put:1:after"),
        ("INT", "upload:3:after"),
        pytest.param("TERM", "batch:6", marks=LOCAL_TOO),
    ],
)
@pytest.mark.slow
def test_killed_then_resumed_equals_uninterrupted(s3, bucket, server, tiny_dirs, corpus, reference, sig, at):
    """A kill at any moment, including between a shard's upload and the manifest PUT that commits
    it: readers see only listed shards, the resume deletes the orphan, and the finished store
    equals an uninterrupted one object for object."""
    url = f"s3://{bucket}/store"
    args = cli_args(tiny_dirs["gpt2"], corpus, url)
    run = server.call("kill_driver:run_cli", args=args, signal_name=sig, kill_at=at, environ=endpoint())
    if sig == "KILL":
        assert run.status == -signal.SIGKILL, run.log[-3000:]
    else:
        assert run.status == 0 and run.result["code"] == 130, run.log[-3000:]
    partial = open_store(url, verify=True)  # a consistent store: only what the manifest lists
    if sig == "INT":  # an interrupt still commits the shard it had uploaded, and no partial one
        assert run.result["stderr"].strip().splitlines()[-1].startswith("hookscope: interrupted after ")
    listed = {s.file for s in partial.manifest.shards}
    shards = {k for k in s3_objects(s3, url) if k.startswith("shards/")}
    if (sig, at) == ("KILL", "upload:3:after"):  # the third shard was uploaded but never committed
        # (the fourth may be uploaded too: shards go up in the background, two at a time)
        orphans = shards - listed
        assert (
            "shards/shard-r000-000002.safetensors"
            in orphans
            <= {"shards/shard-r000-000002.safetensors", "shards/shard-r000-000003.safetensors"}
        )
        assert max(listed, default="") < min(orphans)  # committed in the order cut: none after an orphan
    assert main(args) == 0  # the same command
    assert s3_objects(s3, url) == local_objects(reference)  # orphan gone, everything byte for byte


def open_uploads(s3, bucket: str) -> list[str]:
    """Keys of the multipart uploads begun in `bucket` and neither completed nor aborted."""
    return [u["Key"] for u in s3.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads") or []]


@pytest.mark.slow
def test_killed_mid_multipart_upload_resumes_identical(
    s3, bucket, server, tiny_dirs, corpus, reference, monkeypatch, tmp_path
):
    """SIGKILL between two parts of a shard's multipart upload: no object of that shard exists, its
    upload stays open on S3; the resume aborts it, uploads the shard again, and ends with the
    uninterrupted store's objects and no open upload; and deletes the killed writer's local staging
    directory (its shard half uploaded), leaving another store's alone."""
    monkeypatch.setenv("HOOKSCOPE_UPLOAD_PART_BYTES", "32768")  # shards here are ~170 KB: 6 parts each
    staging = tmp_path / "staging"  # where a URL store's shards are written before their upload
    staging.mkdir()
    monkeypatch.setenv("HOOKSCOPE_STAGING_DIR", str(staging))
    another_store = staging / "hookscope-stage-0123456789ab-shard-r000-writing-live"  # not this store's
    another_store.mkdir()
    url = f"s3://{bucket}/store"
    args = cli_args(tiny_dirs["gpt2"], corpus, url)
    run = server.call(
        "kill_driver:run_cli",
        args=args,
        signal_name="KILL",
        kill_at="part:9:after",
        environ={**endpoint(), "HOOKSCOPE_STAGING_DIR": str(staging)},
    )
    assert run.status == -signal.SIGKILL, run.log[-3000:]
    left = open_uploads(s3, bucket)
    assert left and all(k.startswith("store/shards/") for k in left)  # killed mid-upload, as meant
    killed = [d for d in staging.iterdir() if d != another_store]
    assert len(killed) == 1 and any(killed[0].iterdir())  # the killed writer's shard, left behind
    partial = open_store(url, verify=True)
    assert not {f"shards/{k.rsplit('/', 1)[-1]}" for k in left} & {s.file for s in partial.manifest.shards}
    assert main(args) == 0
    assert s3_objects(s3, url) == local_objects(reference)
    assert open_uploads(s3, bucket) == []
    # the resume deleted the killed writer's staging directory (and its own when done), not another store's
    assert list(staging.iterdir()) == [another_store]


HOSTILE = [
    "truncated",
    "two shards exchanged",
    "shard from another store",
    "manifest lies about a checksum",
    "a listed shard deleted",
]


@pytest.mark.parametrize("fault", HOSTILE)
@pytest.mark.slow
def test_hostile_objects_are_refused(s3, bucket, tiny_dirs, corpus, capsys, fault):
    url = f"s3://{bucket}/store"
    args = cli_args(tiny_dirs["gpt2"], corpus, url, **{"--max-tokens": "800"})
    assert main(args) == 0
    root = f"{bucket}/store"
    first, second = (f"{root}/shards/shard-r000-00000{i}.safetensors" for i in (0, 1))
    if fault in ("truncated", "two shards exchanged"):
        damage(s3, root, fault)
    elif fault == "shard from another store":
        other = f"s3://{bucket}/other"
        other_args = {"--max-tokens": "800", "--context": "16"}
        assert main(cli_args(tiny_dirs["gpt2"], corpus, other, **other_args)) == 0
        s3.pipe_file(first, s3.cat_file(f"{bucket}/other/shards/shard-r000-000000.safetensors"))
    elif fault == "manifest lies about a checksum":
        text = s3.cat_file(f"{root}/manifest.json").decode()
        sha = open_store(url).manifest.shards[0].checksum
        s3.pipe_file(f"{root}/manifest.json", text.replace(sha, "0" * len(sha)).encode())
    else:
        s3.rm_file(second)
    capsys.readouterr()
    with pytest.raises(StoreError, match="shard-r000-00000[01]"):
        open_store(url, verify=True)
    assert main(["inspect", url]) == 2
    assert "shard-r000-00000" in capsys.readouterr().err


@pytest.mark.slow
def test_two_torchrun_ranks_write_to_one_url(s3, bucket, server, tiny_dirs, corpus, reference):
    """Two ranks (fork-server children with torchrun's environment: tests/kit/elastic_kit.py;
    tests/engines/test_tensor_parallel.py launches torchrun itself) write one store at a URL."""
    url = f"s3://{bucket}/store"
    run_ranks(server, 2, cli_args(tiny_dirs["gpt2"], corpus, url), environ=endpoint())
    names = set(s3_objects(s3, url))
    assert {"manifest.json", "manifest.rank0.json", "manifest.rank1.json"} <= names
    two, one = open_store(url, verify=True), open_store(reference)
    assert two.manifest.world_size == 2 and {s.rank for s in two.manifest.shards} == {0, 1}

    def rows(store):
        key = torch.stack([store.tensor("seq_ids"), store.tensor("doc_ids"), store.tensor("positions")], 1)
        order = sorted(range(len(key)), key=lambda i: tuple(key[i].tolist()))
        return key[order], store.tensor("blocks.1.resid_post")[order]

    (k2, v2), (k1, v1) = rows(two), rows(one)
    assert torch.equal(k2, k1) and torch.equal(v2, v1)


@pytest.mark.parametrize(("first", "then"), [(2, 1), pytest.param(1, 2, marks=pytest.mark.full)])
@pytest.mark.slow
def test_elastic_resume_on_a_url(s3, bucket, server, tiny_dirs, corpus, reference, first, then):
    """Started by `first` processes writing to the URL, killed, finished by `then`: the rows of an
    uninterrupted run, and no object that no manifest lists."""
    url = f"s3://{bucket}/store"
    # each rank is killed once its first shard is committed
    args = cli_args(tiny_dirs["gpt2"], corpus, url)
    run_elastic(server, args, first, then, kill_at="manifest-put:2:after", environ=endpoint())
    assert_same_rows_as(url, reference, first, then)
    listed = {s.file for s in open_store(url).manifest.shards}
    assert {k for k in s3_objects(s3, url) if k.startswith("shards/")} == listed
