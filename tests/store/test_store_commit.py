"""Shard commits at scale: a journal line per shard beside a manifest compacted now and then
(store/journal.py). A crash snapshot (the store as a killed writer leaves it) resumes to the
uninterrupted store byte for byte; torn and hostile journals are handled; a store in the format
written before the journal (manifest.json alone) opens, verifies and resumes. How a commit's cost
stays flat is measured by bench/bench_commit.py, not timed here. The kill sweep
(tests/faults/test_faults_kill.py) kills real extractions inside a journal append (`journal-write`)."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from hookscope.errors import StoreError
from hookscope.store import ShardWriter, open_store

SETTINGS = {"test": "commit journal"}
N, CRASH_AT = 10, 6  # batches in the run; shards committed when the snapshot is taken


def batch(i: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(i)
    rows = 3 + i % 2
    return (
        {"x": torch.randn(rows, 4, generator=g).to(torch.bfloat16)},
        {"token_ids": torch.arange(rows) + 100 * i},
    )


def write(out, batches=range(N)) -> None:
    with ShardWriter(out, SETTINGS, shard_rows=1) as w:  # every batch is a shard
        for i in batches:
            if i not in w.done_batches:
                w.write(i, *batch(i))


def files(out: Path) -> dict[str, str]:
    """SHA-256 of every file of the store (debris and journal included)."""
    return {
        p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("commit") / "reference"
    write(out)
    return out


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory) -> Path:
    """The store as a writer killed after CRASH_AT commits leaves it: copied while the writer is
    open, idle, with CRASH_AT shards committed."""
    root = tmp_path_factory.mktemp("commit")
    w = ShardWriter(root / "live", SETTINGS, shard_rows=1)
    for i in range(CRASH_AT):
        w.write(i, *batch(i))
    deadline = time.monotonic() + 60
    while len(w.manifest.shards) < CRASH_AT and time.monotonic() < deadline:
        time.sleep(0.01)
    shutil.copytree(root / "live", root / "snapshot")
    w.close()
    return root / "snapshot"


@pytest.fixture
def crashed(snapshot, tmp_path) -> Path:
    out = tmp_path / "store"
    shutil.copytree(snapshot, out)
    return out


def journal_lines(out: Path) -> list[bytes]:
    path = out / "manifest.journal"
    return path.read_bytes().splitlines(keepends=True) if path.exists() else []


def line(entry: dict) -> bytes:
    """A journal line as docs/store-format.md specifies it: the JSON's SHA-256, a space, the JSON."""
    body = json.dumps(entry, separators=(",", ":")).encode()
    return hashlib.sha256(body).hexdigest().encode() + b" " + body + b"\n"


def test_a_commit_appends_one_checked_line_and_the_manifest_is_rewritten_rarely(snapshot, reference):
    final = json.loads((reference / "manifest.json").read_bytes())
    manifest = json.loads((snapshot / "manifest.json").read_bytes())
    assert len(manifest["shards"]) == 1  # written at the first shard (its columns), not at every one
    lines = journal_lines(snapshot)
    assert len(lines) == CRASH_AT - 1
    for k, raw in enumerate(lines, start=1):
        digest, body = raw.rstrip(b"\n").split(b" ", 1)
        assert hashlib.sha256(body).hexdigest().encode() == digest
        assert json.loads(body) == final["shards"][k]  # the entry the finished manifest lists
    assert not (reference / "manifest.journal").exists()  # compacted at close
    # the finished manifest is json.dumps(..., indent=1) of itself, as before the journal
    assert (reference / "manifest.json").read_bytes() == (json.dumps(final, indent=1) + "\n").encode()


def test_readers_see_every_committed_shard(snapshot):
    store = open_store(snapshot, verify=True)
    assert store.num_shards == CRASH_AT
    want = torch.cat([batch(i)[0]["x"] for i in range(CRASH_AT)])
    assert torch.equal(store.tensor("x"), want)


def test_a_crash_snapshot_resumes_to_the_uninterrupted_store(crashed, reference):
    write(crashed)
    assert files(crashed) == files(reference)  # manifest.json byte for byte, no journal, no debris


@pytest.mark.parametrize("tear", ["half a line", "zeros after the last newline", "no newline"])
def test_a_torn_last_line_is_not_committed(crashed, reference, tear):
    data = (crashed / "manifest.journal").read_bytes()
    last = data.rfind(b"\n", 0, len(data) - 1) + 1
    torn = {
        "half a line": data[: last + (len(data) - last) // 2],
        "zeros after the last newline": data[:last] + bytes(len(data) - last),
        "no newline": data[:-1],
    }[tear]
    (crashed / "manifest.journal").write_bytes(torn)
    assert open_store(crashed, verify=True).num_shards == CRASH_AT - 1
    with ShardWriter(crashed, SETTINGS, shard_rows=1) as w:
        assert w.done_batches == set(range(CRASH_AT - 1))  # the torn shard is written again
        assert not (crashed / f"shards/shard-r000-{CRASH_AT - 1:06d}.safetensors").exists()  # orphan gone
    write(crashed)
    assert files(crashed) == files(reference)


def test_an_entry_already_in_the_manifest_counts_once(crashed, reference):
    """A crash between a compaction and the journal's removal, or a line appended twice."""
    lines = journal_lines(crashed)
    (crashed / "manifest.journal").write_bytes(b"".join([*lines, lines[0], lines[2]]))
    assert open_store(crashed).num_shards == CRASH_AT
    write(crashed)
    assert files(crashed) == files(reference)


def _edit_entry(lines: list[bytes], k: int, **changes) -> bytes:
    entry = json.loads(lines[k].rstrip(b"\n").split(b" ", 1)[1])
    return line({**entry, **changes})


def _new_entry(lines: list[bytes], **changes) -> bytes:
    """A line for a shard no one committed (batch 99), with `changes`."""
    return _edit_entry(
        lines, 0, file="shards/shard-r000-000099.safetensors", batches=[[99, 99, 1]], **changes
    )


def _not_hex(lines: list[bytes]) -> bytes:
    entry = json.loads(lines[0].rstrip(b"\n").split(b" ", 1)[1])
    key = next(k for k in ("sha256", "xxh3_128") if k in entry)  # the algorithm the entry names
    return _new_entry(lines, **{key: "z" * len(entry[key])})


HOSTILE = {
    "garbage in the middle": (lambda ls: [ls[0], b"not a journal line\n", *ls[2:]], r"line 2: .*SHA"),
    "wrong hash": (lambda ls: [ls[0], b"0" * 64 + ls[1][64:], *ls[2:]], r"line 2: its SHA-256 does not"),
    "not JSON, hash right": (lambda ls: [line_of(b"{oops"), *ls], r"line 1: not JSON"),
    "the same shard twice, differently": (
        lambda ls: [*ls, _edit_entry(ls, 1, rows=1)],
        r"committed twice, with different entries",
    ),
    "an entry for a missing file": (lambda ls: [*ls, _new_entry(ls)], r"missing"),
    "an entry of another rank": (lambda ls: [*ls, _new_entry(ls, rank=1)], r"cannot belong to manifest.json"),
    "a negative row count": (lambda ls: [*ls, _new_entry(ls, rows=-1)], r"line 6: entry.rows is -1"),
    "more rows than bytes": (lambda ls: [*ls, _new_entry(ls, rows=10**9)], r"claims 1000000000 rows"),
    "a checksum that is not hex": (lambda ls: [_not_hex(ls), *ls], r"line 1: .*is not a hex"),
    "stats of another point": (lambda ls: [*ls, _new_entry(ls, stats={})], r"has stats for \[\]"),
    "a batch in two shards": (
        lambda ls: [*ls, _edit_entry(ls, 0, file="shards/shard-r000-000042.safetensors")],
        r"batch 1 is in both",
    ),
}


def line_of(body: bytes) -> bytes:
    return hashlib.sha256(body).hexdigest().encode() + b" " + body + b"\n"


@pytest.mark.parametrize("fault", HOSTILE)
def test_a_hostile_journal_is_refused_with_a_clear_error(crashed, fault):
    damage, message = HOSTILE[fault]
    (crashed / "manifest.journal").write_bytes(b"".join(damage(journal_lines(crashed))))
    before = files(crashed)
    with pytest.raises(StoreError, match=message):
        open_store(crashed)
    if "missing" not in message:  # a writer reads the same journal (a missing shard is verify's to find)
        with pytest.raises(StoreError, match=message):
            ShardWriter(crashed, SETTINGS, shard_rows=1)
        assert files(crashed) == before  # refused before anything was touched


def test_a_store_of_the_format_before_the_journal_opens_verifies_and_resumes(reference, tmp_path):
    """A store as the writer before the journal left it when killed after CRASH_AT shards: a
    manifest.json listing them, no journal. Its bytes are what a finished store's manifest.json
    still is (json.dumps(..., indent=1), as the first test checks), so a finished run of the first
    CRASH_AT batches makes one; checked here to hold the shards it lists and nothing else."""
    out = tmp_path / "old"
    write(out, range(CRASH_AT))
    final, old = (json.loads((d / "manifest.json").read_bytes()) for d in (reference, out))
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "manifest.json", "shards"]
    assert old["shards"] == final["shards"][:CRASH_AT]
    assert (out / "manifest.json").read_bytes() == (json.dumps(old, indent=1) + "\n").encode()
    store = open_store(out, verify=True)
    assert store.num_shards == CRASH_AT and len(store) == sum(s["rows"] for s in old["shards"])
    write(out)
    assert files(out) == files(reference)


def test_a_store_at_a_url_commits_one_object_per_shard(tmp_path, reference):
    """No append on an object store: each commit is an object under manifest.journal/, which
    readers see, and which the close compacts into manifest.json."""
    import fsspec

    url = "memory://commit-journal/store"
    mem = fsspec.filesystem("memory")
    w = ShardWriter(url, SETTINGS, shard_rows=1)
    for i in range(CRASH_AT):
        w.write(i, *batch(i))
    deadline = time.monotonic() + 60
    while len(w.manifest.shards) < CRASH_AT and time.monotonic() < deadline:
        time.sleep(0.01)
    records = sorted(p.rsplit("/", 1)[-1] for p in mem.find("/commit-journal/store/manifest.journal"))
    assert records == [f"shard-r000-{k:06d}" for k in range(1, CRASH_AT)]
    assert open_store(url).num_shards == CRASH_AT
    for i in range(CRASH_AT, N):
        w.write(i, *batch(i))
    w.close()
    assert not mem.find("/commit-journal/store/manifest.journal")
    assert mem.cat_file("/commit-journal/store/manifest.json") == (reference / "manifest.json").read_bytes()
    mem.rm("/commit-journal", recursive=True)


def test_verify_names_every_damaged_shard(reference, tmp_path):
    out = tmp_path / "damaged"
    shutil.copytree(reference, out)
    for k in (2, 7):  # a flipped byte in the last row's data: size and header intact
        path = out / f"shards/shard-r000-{k:06d}.safetensors"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    for workers in (1, 8):
        with pytest.raises(StoreError, match=r"2 of 10 shards are damaged") as err:
            open_store(out).verify(workers=workers)
        assert "shard-r000-000002" in str(err.value) and "shard-r000-000007" in str(err.value)


def test_a_second_run_on_a_store_is_refused_while_the_first_writes(tmp_path, reference):
    out = tmp_path / "store"
    first = ShardWriter(out, SETTINGS, shard_rows=1)
    first.write(0, *batch(0))
    with pytest.raises(StoreError, match="another run is writing this store right now"):
        ShardWriter(out, SETTINGS, shard_rows=1)
    first.close()
    write(out)  # once the first has finished, the same command resumes
    assert files(out) == files(reference)  # and the lock went with it


def test_compactions_mid_run_leave_the_same_store(tmp_path, reference, monkeypatch):
    """The manifest rewritten whenever the journal is as long as it (here from 2 lines on, not
    1,024): the finished store is the same, and mid-run the journal stays short."""
    from hookscope.store import journal

    monkeypatch.setattr(journal, "COMPACT_AFTER", 2)
    out = tmp_path / "store"
    w = ShardWriter(out, SETTINGS, shard_rows=1)
    for i in range(N - 1):
        w.write(i, *batch(i))
    deadline = time.monotonic() + 60
    while len(w.manifest.shards) < N - 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    listed = len(json.loads((out / "manifest.json").read_bytes())["shards"])
    assert listed >= 4 and listed + len(journal_lines(out)) == N - 1  # compacted mid-run, nothing lost
    assert open_store(out).num_shards == N - 1
    w.write(N - 1, *batch(N - 1))
    w.close()
    assert files(out) == files(reference)


def test_a_commit_costs_the_same_whatever_the_store_holds(tmp_path, monkeypatch):
    """A commit adds to the shard list and the done batches in place: copying either (a new list, a
    new frozenset) costs O(shards) per commit, so a run's bookkeeping would grow with its square.
    Counted, not timed: no commit after the first may copy the shard list or the done set; and a
    commit that fails leaves the manifest in memory without its shard."""
    import hookscope.store.journal as journal

    out = tmp_path / "store"
    with ShardWriter(out, SETTINGS, shard_rows=1) as w:
        w.write(0, *batch(0))
    copies = []
    real = journal.with_shard

    def watched(old, entry, layout, stats):
        before = old.shards
        new = real(old, entry, layout, stats)
        copies.append(new.shards is not before)
        return new

    monkeypatch.setattr(journal, "with_shard", watched)
    with ShardWriter(out, SETTINGS, shard_rows=1) as w:
        done = w.done_batches
        for i in range(1, N):
            w.write(i, *batch(i))
    assert copies == [False] * (N - 1)
    assert w.done_batches is done and done == set(range(N))

    def refused(self, entry):
        raise OSError("journal disk full")

    monkeypatch.setattr(journal.Commits, "append", refused)
    w = ShardWriter(out, SETTINGS, shard_rows=1)
    shards = len(w.manifest.shards)
    w.write(N, *batch(N))
    with pytest.raises(StoreError, match="journal disk full"):
        w.close()
    assert len(w.manifest.shards) == shards and N not in w.done_batches
