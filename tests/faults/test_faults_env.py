"""Environment faults during extraction: a full disk (injected at each write, and a real one on a
tiny tmpfs), a read-only filesystem, the output directory deleted mid-run, and a reader opened
while a writer is still writing.

Each must end in a clear StoreError (exit code 2 with a message from the CLI) with the rows already
committed intact, and, once the cause is gone, the same command completes the store exactly as an
uninterrupted run writes it. test_store.py covers a full disk at a shard write of the store alone
and a directory under a regular file; this file drives the whole pipeline.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import io
import os
import shutil
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from fault_log import record
from faultkit import compare_stores, extract_config, shard_digests, write_corpus
from forkserver import ForkServer

from hookscope.cli import main
from hookscope.errors import StoreError
from hookscope.extract import ExtractConfig, extract
from hookscope.store import open_store
from hookscope.store import writer as writer_module

MAX_TOKENS = 1600  # 12 batches of 4 x 32 tokens, 2 to a shard


def argv(config: dict) -> list[str]:
    """The `hookscope extract` command line for an extract_config()."""
    return [
        "extract",
        config["model"],
        "--out",
        config["out"],
        "--points",
        ",".join(config["points"]),
        "--data",
        config["data"],
        "--context",
        str(config["context"]),
        "--batch-size",
        str(config["batch_size"]),
        "--dtype",
        config["dtype"],
        "--shard-rows",
        str(config["shard_rows"]),
        "--no-progress",
        *(["--max-tokens", str(config["max_tokens"])] if config.get("max_tokens") else []),
    ]


def run_cli(args: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(args)
    return code, err.getvalue()


@pytest.fixture(scope="module")
def setup(tiny_dirs, tmp_path_factory) -> tuple[dict, Path]:
    """(config without `out`, an uninterrupted reference store)."""
    root = tmp_path_factory.mktemp("env")
    corpus = write_corpus(root / "corpus.txt")
    config = extract_config(tiny_dirs["gpt2"], corpus, root / "ref", max_tokens=MAX_TOKENS)
    extract(ExtractConfig(**config))
    assert open_store(root / "ref").num_shards >= 5
    return config, root / "ref"


def committed_prefix_intact(out: Path, ref: Path) -> int:
    """The rows committed before a failure verify and equal the reference's first rows; how many."""
    store, want = open_store(out, verify=True), open_store(ref)
    if not store.num_shards:  # the failure came at the first shard's commit: nothing to compare
        return 0
    for name in want.manifest.columns:
        got, first = store.tensor(name), want.tensor(name)[: len(store)]
        assert torch.equal(got.view(torch.uint8), first.view(torch.uint8))  # bit for bit
    return len(store)


# -- a full disk ----------------------------------------------------------------------------------


ENOSPC_SITES = {  # (where, which occurrence) -> what the table calls it
    ("save", 3): "disk full writing a shard",
    ("shard-fsync", 2): "disk full at a shard's fsync",
    ("manifest-fsync", 2): "disk full at the manifest's fsync",  # the first shard's commit writes it
    ("journal-fsync", 3): "disk full at a shard's commit record (journal fsync)",
    ("manifest-fsync", 1): "disk full stamping the manifest at start",
}


def inject_enospc(monkeypatch, site: str, n: int) -> None:
    counts: Counter[str] = Counter()
    real_fsync, real_save = os.fsync, writer_module.save_columns

    def full() -> OSError:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        kind = None
        if path.endswith(".tmp"):
            kind = "manifest-fsync" if path.endswith(".json.tmp") else "shard-fsync"
        elif path.endswith(".journal"):
            kind = "journal-fsync"
        counts[kind] += 1
        if kind == site and counts[kind] == n:
            raise full()
        real_fsync(fd)

    def save_columns(columns, path, *args, **kw):
        counts["save"] += 1
        if site == "save" and counts["save"] == n:
            Path(path).write_bytes(b"the first blocks")  # what a full disk leaves behind
            raise full()
        return real_save(columns, path, *args, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(writer_module, "save_columns", save_columns)


@pytest.mark.parametrize("site, n", list(ENOSPC_SITES), ids=list(ENOSPC_SITES.values()))
@pytest.mark.slow
def test_a_full_disk_is_a_clear_error_and_the_same_command_resumes(site, n, setup, tmp_path, monkeypatch):
    config, ref = setup
    out = tmp_path / "store"
    config = {**config, "out": str(out)}
    with monkeypatch.context() as patch:
        inject_enospc(patch, site, n)
        code, err = run_cli(argv(config))
    committed = committed_prefix_intact(out, ref) if (out / "manifest.json").exists() else 0
    debris = list(out.rglob("*.tmp"))  # a failed write gives its blocks back
    code_again, _ = run_cli(argv(config))  # space freed: the same command again
    diff = compare_stores(out, ref)
    ok = code == 2 and "No space left on device" in err and code_again == 0 and diff["same_files"]
    record(
        "env",
        ENOSPC_SITES[site, n],
        survived=int(ok),
        rows_checked=diff["rows"],
        rows_lost=diff["rows_lost"],
        rows_duplicated=diff["rows_duplicated"],
    )
    assert code == 2 and err.startswith("hookscope: error: ") and "No space left on device" in err, err
    assert "re-run" in err or "free" in err  # it says what to do
    assert committed < len(open_store(ref)) and not debris
    assert code_again == 0
    assert diff == {**diff, "rows_lost": 0, "rows_duplicated": 0, "same_values": True, "same_files": True}


# -- the output directory deleted mid-run ---------------------------------------------------------


@pytest.mark.parametrize("moment", ["before a shard write", "before a manifest replace"])
def test_the_output_directory_deleted_mid_run_is_a_clear_error(moment, setup, tmp_path, monkeypatch):
    config, ref = setup
    out = tmp_path / "store"
    config = {**config, "out": str(out)}
    calls = Counter()
    real_save, real_replace = writer_module.save_columns, os.replace

    def save_columns(columns, path, *args, **kw):
        calls["save"] += 1
        if moment == "before a shard write" and calls["save"] == 3:
            shutil.rmtree(out)
        return real_save(columns, path, *args, **kw)

    def replace(src, dst):
        calls[str(dst).endswith(".json")] += 1
        if moment == "before a manifest replace" and str(dst).endswith(".json") and calls[True] == 3:
            shutil.rmtree(out)
        real_replace(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(writer_module, "save_columns", save_columns)
        patch.setattr(os, "replace", replace)
        code, err = run_cli(argv(config))
    code_again, _ = run_cli(argv(config))  # the same command starts over
    diff = compare_stores(out, ref)
    ok = code == 2 and "deleted" in err and code_again == 0 and diff["same_files"]
    record("env", f"output directory deleted mid-run ({moment})", survived=int(ok))
    assert code == 2 and err.startswith("hookscope: error: "), err
    assert "deleted" in err and "start over" in err and "intact" not in err, err
    assert code_again == 0 and diff["same_files"] and diff["rows_lost"] == diff["rows_duplicated"] == 0


# -- a reader while the writer writes -------------------------------------------------------------


def test_a_reader_sees_only_complete_shards_while_a_shard_is_half_written(setup, tmp_path, monkeypatch):
    """The writer thread is held in the middle of its third shard (half its bytes on disk under the
    .tmp name): a reader opened then sees exactly the two committed shards, verified."""
    config, ref = setup
    out = tmp_path / "store"
    halfway, release, real_save = threading.Event(), threading.Event(), writer_module.save_columns

    def committed() -> int:  # what a reader sees: a shard file lands before its commit lists it
        return open_store(out).num_shards

    def save_columns(columns, path, *args, **kw):
        out_ = real_save(columns, path, *args, **kw)
        if Path(path).name.startswith("shard-r000-000002."):
            deadline = time.monotonic() + 30  # the commit thread may still be committing the second
            while committed() < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            data = Path(path).read_bytes()
            Path(path).write_bytes(data[: len(data) // 2])
            halfway.set()
            release.wait(30)
            Path(path).write_bytes(data)
        return out_

    monkeypatch.setattr(writer_module, "save_columns", save_columns)
    runner = threading.Thread(target=extract, args=(ExtractConfig(**{**config, "out": str(out)}),))
    runner.start()
    assert halfway.wait(60)
    try:
        store, want = open_store(out, verify=True), open_store(ref)
        half = [p.relative_to(out).as_posix() for p in out.glob("shards/**/*.tmp")]
        rows = store.tensor("token_ids")
    finally:
        release.set()
        runner.join(60)
    complete = (
        store.num_shards == 2
        and len(rows) == want.first_row(2)
        and torch.equal(rows, want.tensor("token_ids")[: len(rows)])
    )
    record("env", "reader opened while a shard is half-written", survived=int(complete))
    assert half == ["shards/shard-r000-writing/shard-r000-000002.safetensors.tmp"]  # opened mid-write
    assert complete, (store.num_shards, len(rows))  # and saw the two committed shards, no more
    assert compare_stores(out, ref)["same_files"]


@pytest.mark.slow
def test_a_reader_polling_a_live_extraction_sees_only_complete_prefixes(setup, tmp_path):
    """An extraction runs in another process while this one opens, verifies and reads the store as
    fast as it can: every snapshot is a verified prefix of the finished store."""
    config, _ = setup
    out = tmp_path / "store"
    config = {**config, "out": str(out), "max_tokens": None, "shard_rows": 40}
    server = ForkServer.shared()
    server.warm("faultkit:load_model", path=config["model"])
    replies = []

    def write() -> None:
        replies.append(server.call("kill_driver:run_extract", config=config))

    writer = threading.Thread(target=write)
    writer.start()
    snapshots = []
    while writer.is_alive():
        try:
            store = open_store(out, verify=True)
        except StoreError as e:  # only before the first manifest is stamped
            assert "no manifest here" in str(e) or "no such store" in str(e), e
            continue
        if store.num_shards:  # before the first shard the store has no columns yet
            snapshots.append((store.manifest.shards, store.tensor("blocks.1.resid_post")))
    writer.join()
    assert replies[0].status == 0, replies[0].log[-2000:]
    final = open_store(out, verify=True)
    full = final.tensor("blocks.1.resid_post")
    growing = [len(s) for s, _ in snapshots]
    prefixes = sum(
        shards == final.manifest.shards[: len(shards)] and torch.equal(rows, full[: len(rows)])
        for shards, rows in snapshots
    )
    record("env", "reader polling a live extraction (snapshots)", tried=len(snapshots), survived=prefixes)
    assert prefixes == len(snapshots) and len(set(growing)) >= 3  # several different moments were seen
    assert growing == sorted(growing)


# -- a real full disk and a read-only filesystem, on a tmpfs of our own ---------------------------


MS_RDONLY, MS_REMOUNT = 1, 32


def own_tmpfs(mount_at: str, size_kb: int):
    """In a fork-server child: a mount namespace of its own with a tmpfs of `size_kb` KiB at
    `mount_at`; returns `mount(source, target, fstype, flags, data)` for remounts. OSError if the
    process may not."""
    libc = ctypes.CDLL(None, use_errno=True)

    def mount(source, target, fstype, flags, data) -> None:
        if libc.mount(source, target, fstype, flags, data) != 0:
            raise OSError(ctypes.get_errno(), f"mount {target}: {os.strerror(ctypes.get_errno())}")

    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        raise OSError(ctypes.get_errno(), f"unshare: {os.strerror(ctypes.get_errno())}")
    mount(None, b"/", None, 16384 | (1 << 18), None)  # MS_REC | MS_PRIVATE: nothing reaches the host's
    os.makedirs(mount_at, exist_ok=True)
    mount(b"tmpfs", mount_at.encode(), b"tmpfs", 0, f"size={size_kb}k".encode())
    return mount


def tiny_tmpfs(config: dict, mount_at: str, size_kb: int, copy_to: str) -> dict:
    """In a fork-server child: in a mount namespace of its own, extract onto a tmpfs of `size_kb`
    KiB until it is full; look at what is left; grow the tmpfs; run the same command again; copy the
    store out. Then remount the tmpfs read-only and try a new store and a resume there."""
    try:
        mount = own_tmpfs(mount_at, size_kb)
    except OSError as e:
        return {"skip": f"cannot mount a tmpfs of our own here: {e}"}
    out = os.path.join(mount_at, "store")
    full = run_cli(argv({**config, "out": out}))
    store = open_store(out, verify=True)
    left = {"rows": len(store), "files": sorted(p.name for p in Path(out, "shards").iterdir())}
    mount(b"tmpfs", mount_at.encode(), b"tmpfs", MS_REMOUNT, b"size=64m")
    again = run_cli(argv({**config, "out": out}))
    shutil.copytree(out, copy_to)
    mount(b"tmpfs", mount_at.encode(), b"tmpfs", MS_REMOUNT | MS_RDONLY, b"size=64m")
    new_store = run_cli(argv({**config, "out": os.path.join(mount_at, "new")}))
    resume = run_cli(argv({**config, "out": out}))
    return {
        "full": full,
        "left": left,
        "again": again,
        "read_only_new": new_store,
        "read_only_resume": resume,
    }


@pytest.mark.slow
def test_a_real_full_disk_and_a_read_only_filesystem(setup, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    config, ref = setup
    reply = ForkServer.shared().call(
        "test_faults_env:tiny_tmpfs",
        config={**config, "out": ""},
        mount_at=str(tmp_path / "mnt"),
        size_kb=160,
        copy_to=str(tmp_path / "copy"),
    )
    assert reply.status == 0, reply.log[-3000:]
    if "skip" in reply.result:
        pytest.skip(reply.result["skip"])
    r = reply.result
    diff = compare_stores(tmp_path / "copy", ref)
    full_ok = r["full"][0] == 2 and "No space left on device" in r["full"][1] and r["again"][0] == 0
    record(
        "env",
        "disk really full (a 160 KiB tmpfs)",
        survived=int(full_ok and diff["same_files"]),
        rows_checked=diff["rows"],
        rows_lost=diff["rows_lost"],
        rows_duplicated=diff["rows_duplicated"],
    )
    ro_ok = [
        r[k][0] == 2 and "Read-only file system" in r[k][1] for k in ("read_only_new", "read_only_resume")
    ]
    record("env", "read-only filesystem (new store, resume)", tried=2, survived=sum(ro_ok))
    assert r["full"][0] == 2 and "No space left on device" in r["full"][1], r["full"]
    assert 0 < r["left"]["rows"] < len(open_store(ref))  # some shards made it, the rest did not
    assert not [f for f in r["left"]["files"] if f.endswith(".tmp")]
    assert r["again"][0] == 0, r["again"]
    assert diff == {**diff, "rows_lost": 0, "rows_duplicated": 0, "same_values": True, "same_files": True}
    assert ro_ok == [True, True], (r["read_only_new"], r["read_only_resume"])
    assert shard_digests(tmp_path / "copy") == shard_digests(ref)


def full_beside_a_held_commit(config: dict, mount_at: str, size_kb: int, copy_to: str) -> dict:
    """In a fork-server child: extract onto a tmpfs of `size_kb` KiB, the first shard's commit
    (on the commit thread) held until the second shard's save has returned or failed, as a loaded
    machine may schedule it; count the commits that found the disk full; copy the store out."""
    try:
        own_tmpfs(mount_at, size_kb)
    except OSError as e:
        return {"skip": f"cannot mount a tmpfs of our own here: {e}"}
    from hookscope.store import journal

    saved, calls = threading.Event(), Counter()
    real_save, real_sync = writer_module.save_columns, writer_module.sync_file
    real_commit = journal.Commits.commit

    def save_columns(*args, **kw):
        calls["save"] += 1
        try:
            return real_save(*args, **kw)
        finally:
            if calls["save"] == 2:
                saved.set()

    def sync_file(path) -> None:
        calls["sync"] += 1
        if calls["sync"] == 1:
            saved.wait(60)
        real_sync(path)

    def commit(self, *args, **kw):
        try:
            return real_commit(self, *args, **kw)
        except OSError as e:
            calls[f"commit {errno.errorcode[e.errno]}"] += 1
            raise

    writer_module.save_columns, writer_module.sync_file = save_columns, sync_file
    journal.Commits.commit = commit
    out = os.path.join(mount_at, "store")
    full = run_cli(argv({**config, "out": out}))
    shutil.copytree(out, copy_to)
    return {
        "full": full,
        "commits_found_disk_full": calls["commit ENOSPC"],
        "files": sorted(p.name for p in Path(out, "shards").iterdir()),
    }


@pytest.mark.slow
def test_a_full_disk_while_the_shard_before_commits_keeps_that_shard(setup, tmp_path):
    """The second shard's bytes fill the disk while the first shard's commit waits its turn (the
    commit thread starved): the commit finds no room for the manifest. That shard is whole and in
    place: once the second one is deleted, it commits; the run stops with the disk full, and the
    first shard's rows are in the store."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    config, ref = setup
    reply = ForkServer.shared().call(
        "test_faults_env:full_beside_a_held_commit",
        config={**config, "out": ""},
        mount_at=str(tmp_path / "mnt"),
        size_kb=160,
        copy_to=str(tmp_path / "copy"),
    )
    assert reply.status == 0, reply.log[-3000:]
    if "skip" in reply.result:
        pytest.skip(reply.result["skip"])
    r, first = reply.result, open_store(ref).manifest.shards[0]
    kept = committed_prefix_intact(tmp_path / "copy", ref)  # verified, bit for bit the reference's rows
    record(
        "env",
        "disk filled by the next shard while a shard commits",
        survived=int(kept == first.rows),
        rows_checked=kept,
        rows_lost=first.rows - kept,
    )
    assert r["commits_found_disk_full"] >= 1, r  # the first commit did meet the full disk
    assert r["full"][0] == 2 and "No space left on device" in r["full"][1], r["full"]
    assert kept == first.rows and r["files"] == [Path(first.file).name], r
