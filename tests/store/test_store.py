"""The activation store: round trips, crash-resume, refusals, corruption, and the shuffled reader."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from forkserver import ForkServer

from hookscope.errors import StoreError
from hookscope.store import Manifest, ShardWriter, merge_rank_manifests, open_store
from hookscope.store import writer as writer_module
from hookscope.store.fs import LocalFS
from hookscope.store.journal import load_manifest

HERE = Path(__file__).resolve().parent
SETTINGS = {"model": "tiny", "points": ["blocks.1.resid_post", "blocks.1.attn.z"], "context": 8, "seed": 0}
N_BATCHES = 12
SHARD_ROWS = 20


def make_batch(i: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Batch i of a fake extraction: its rows depend only on i (so every run writes the same)."""
    g = torch.Generator().manual_seed(1000 + i)
    rows = 5 + i % 4  # uneven batches, so shards cut at different offsets
    acts = {
        "blocks.1.resid_post": torch.randn(rows, 6, generator=g).to(torch.bfloat16),
        "blocks.1.attn.z": torch.randn(rows, 2, 3, generator=g).to(torch.float16),  # per-head rank-3 rows
    }
    meta = {
        "token_ids": torch.randint(0, 30000, (rows,), generator=g),
        "doc_ids": torch.full((rows,), i // 3),
        "positions": torch.arange(rows),
        "seq_ids": torch.full((rows,), i, dtype=torch.int32),  # int32 in, stored as int64
    }
    return acts, meta


def write_all(out: Path, batches=range(N_BATCHES), **kw) -> ShardWriter:
    with ShardWriter(out, SETTINGS, shard_rows=SHARD_ROWS, **kw) as w:
        for i in batches:
            if i in w.done_batches:
                continue
            w.write(i, *make_batch(i))
    return w


def expected_columns(batches=range(N_BATCHES)) -> dict[str, torch.Tensor]:
    parts = [make_batch(i) for i in batches]
    names = [*parts[0][0], *parts[0][1]]
    return {k: torch.cat([{**a, **m}[k] for a, m in parts]) for k in names}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so NaNs compare equal and nothing is rounded."""
    return t.view(torch.int16) if t.element_size() == 2 else t


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    write_all(tmp_path / "ref")
    return tmp_path / "ref"


# -- writing and reading back ---------------------------------------------------------------------


def test_round_trip_is_bitwise_and_traceable(store_dir: Path):
    store = open_store(store_dir, verify=True)
    want = expected_columns()
    assert len(store) == sum(len(v) for v in [want["token_ids"]]) == 12 * 5 + 3 * (0 + 1 + 2 + 3)
    assert set(store.points) == {"blocks.1.resid_post", "blocks.1.attn.z"}
    assert (
        store.points["blocks.1.attn.z"].shape == (2, 3) and store.points["blocks.1.attn.z"].dtype == "float16"
    )
    assert store.points["blocks.1.resid_post"].dtype == "bfloat16"
    assert set(store.meta) == {"token_ids", "doc_ids", "positions", "seq_ids"}
    for name, t in want.items():
        got = store.tensor(name)
        assert got.dtype == (t.dtype if name in store.points else torch.int64)
        assert torch.equal(bits(got), bits(t.to(got.dtype))), name
    row = store[23]
    assert torch.equal(bits(row["blocks.1.resid_post"]), bits(want["blocks.1.resid_post"][23]))
    assert int(row["token_ids"]) == int(want["token_ids"][23])
    assert np.array_equal(store.to_numpy("blocks.1.resid_post"), want["blocks.1.resid_post"].float().numpy())
    assert np.array_equal(store.to_numpy("blocks.1.attn.z"), want["blocks.1.attn.z"].numpy())


def test_shards_are_memory_mapped_whole_batches_with_checksums(store_dir: Path):
    store = open_store(store_dir)
    m = store.manifest
    assert (
        m.settings == SETTINGS
        and m.settings_hash
        == hashlib.sha256(json.dumps(SETTINGS, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    )
    covered = []
    for i, entry in enumerate(m.shards):
        data = (store_dir / entry.file).read_bytes()
        assert entry.bytes == len(data) and entry.algorithm == "xxh3_128"
        assert entry.checksum == xxhash.xxh3_128(data).hexdigest()
        assert entry.file == f"shards/shard-r000-{i:06d}.safetensors"
        batches = list(range(entry.batch_start, entry.batch_end + 1))
        assert entry.rows == sum(len(make_batch(b)[1]["positions"]) for b in batches)
        assert entry.rows >= SHARD_ROWS or i == len(m.shards) - 1  # cut at the first batch boundary past 20
        covered += batches
        shard = store.shard(i)
        assert shard["token_ids"].shape == (entry.rows,)
    assert covered == list(range(N_BATCHES))
    assert m.rows == len(store) and m.bytes == sum(s.bytes for s in m.shards)
    assert sorted(p.name for p in (store_dir / "shards").iterdir()) == [Path(s.file).name for s in m.shards]


def test_nonfinite_values_are_counted_and_norm_stats_exclude_them(tmp_path: Path):
    x = torch.arange(12.0).reshape(4, 3)
    x[1, 0], x[2, 2], x[2, 1] = float("nan"), float("inf"), float("-inf")
    with ShardWriter(tmp_path / "s", {"k": 1}, shard_rows=2) as w:
        w.write(0, {"p": x[:2]})
        w.write(1, {"p": x[2:]})
    assert w.nonfinite == {"p": 3}
    stats = open_store(tmp_path / "s").stats["p"]
    finite_norms = x[[0, 3]].norm(dim=1).double()
    assert (stats.nonfinite, stats.norm_count) == (3, 2)
    assert stats.norm_sum == pytest.approx(float(finite_norms.sum()))
    assert stats.norm_sumsq == pytest.approx(float((finite_norms**2).sum()))
    assert stats.norm_mean == pytest.approx(float(finite_norms.mean()))


def test_writer_checks_what_it_is_given(tmp_path: Path):
    with ShardWriter(tmp_path / "s", {"k": 1}) as w:
        w.write(0, {"p": torch.zeros(3, 4)}, {"token_ids": torch.arange(3)})
        with pytest.raises(StoreError, match="same first"):
            w.write(1, {"p": torch.zeros(3, 4)}, {"token_ids": torch.arange(2)})
        with pytest.raises(StoreError, match=r"p \(5,\) float32"):
            w.write(1, {"p": torch.zeros(3, 5)}, {"token_ids": torch.arange(3)})
        with pytest.raises(StoreError, match="increasing"):
            w.write(0, {"p": torch.zeros(3, 4)}, {"token_ids": torch.arange(3)})
        with pytest.raises(StoreError, match="1-D integer"):
            w.write(1, {"p": torch.zeros(3, 4)}, {"token_ids": torch.zeros(3)})
    with pytest.raises(StoreError, match="already in the store"), ShardWriter(tmp_path / "s", {"k": 1}) as w:
        w.write(0, {"p": torch.zeros(3, 4)}, {"token_ids": torch.arange(3)})


def test_a_slow_disk_blocks_the_caller_after_queue_size_batches(tmp_path: Path, monkeypatch):
    gate, real_save = threading.Event(), writer_module.save_columns

    def slow_save(columns, path, *args, **kw):
        gate.wait()
        return real_save(columns, path, *args, **kw)

    monkeypatch.setattr(writer_module, "save_columns", slow_save)
    w = ShardWriter(tmp_path / "s", {"k": 1}, shard_rows=1, queue_size=2)
    returned: list[int] = []

    def produce():
        for i in range(10):
            w.write(i, {"p": torch.full((1, 2), i)})
            returned.append(i)

    producer = threading.Thread(target=produce)
    producer.start()
    deadline = time.monotonic() + 10
    while len(returned) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert returned == [0, 1, 2]  # batch 0 is being written, 1 and 2 wait in the queue, 3 blocks
    gate.set()
    producer.join()
    w.close()
    assert open_store(tmp_path / "s").tensor("p")[:, 0].tolist() == list(range(10))


# -- resume ---------------------------------------------------------------------------------------


def crash_writer(mode: str, out: str) -> None:
    """Write the store of `write_all` to `out` and die at the moment `mode` names (run in a child:
    a fork-server child, or a fresh Python for "poll", which a SIGKILL from outside ends)."""
    from kill_driver import die_at_file_size, die_in_next_write

    if mode == "inside_library":
        die_at_file_size()
    real_replace, real_save = os.replace, writer_module.save_columns
    shards_done = saves = 0

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def replace(src, dst):  # the shard is renamed into place, but the manifest never learns of it
        nonlocal shards_done
        real_replace(src, dst)
        if str(dst).endswith(".safetensors"):
            shards_done += 1
            if mode == "after_rename" and shards_done == 2:
                die()

    def save_columns(columns, path, *args, **kw):  # killed with the shard half-done under its .tmp name
        nonlocal saves
        saves += 1  # counted here: the shard before may still be committing on the writer's commit thread
        if mode == "inside_library" and saves == 3:  # or in the middle of its bytes
            die_in_next_write(sum(p.nbytes for parts in columns.values() for p in parts) // 2)
        written = real_save(columns, path, *args, **kw)
        if mode == "after_tmp" and saves == 3:
            die()
        return written

    os.replace, writer_module.save_columns = replace, save_columns
    with ShardWriter(out, SETTINGS, shard_rows=SHARD_ROWS) as w:
        for i in range(N_BATCHES):
            w.write(i, *make_batch(i))
            if mode == "poll":
                time.sleep(0.15)
        if mode == "poll":
            time.sleep(60)  # never close on its own: the last shard is only written by close()


# "poll" in a fresh Python: the test watches its manifest and kills it from outside
_CHILD = """
import sys
sys.path[:0] = [{here!r}, {kit!r}]
from test_store import crash_writer
crash_writer(sys.argv[1], sys.argv[2])
"""


def committed_manifest(out: Path) -> Manifest:
    """What a crashed writer committed: its manifest and the commits journaled beside it."""
    return load_manifest(LocalFS(out), "manifest.json")


def _killed_once_two_shards_are_committed(out: Path) -> int:
    """A fresh Python writing `out` slowly, SIGKILLed from here once its manifest lists two shards;
    its exit status."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD.format(here=str(HERE), kit=str(HERE.parent / "kit")), "poll", str(out)]
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and child.poll() is None:
        try:
            if len(committed_manifest(out).shards) >= 2:  # manifest.json + manifest.journal
                break
        except (OSError, ValueError, StoreError):
            pass
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    return child.wait(timeout=60)


@pytest.mark.parametrize("mode", ["after_tmp", "after_rename", "inside_library", "poll"])
@pytest.mark.slow
def test_resume_after_sigkill_equals_an_uninterrupted_run(tmp_path: Path, store_dir: Path, mode: str):
    out = tmp_path / "crashed"
    if mode != "poll":  # it kills itself at its moment: a child of the fork server, no Python start-up
        died = ForkServer.shared().call("test_store:crash_writer", mode=mode, out=str(out)).status
    else:  # the real thing: SIGKILL from outside once two shards are committed
        died = _killed_once_two_shards_are_committed(out)
    assert died == -(signal.SIGXFSZ if mode == "inside_library" else signal.SIGKILL)
    leftovers = {p.relative_to(out / "shards").as_posix() for p in (out / "shards").rglob("*")}
    committed = committed_manifest(out)
    if mode == "after_tmp":  # in the writer's own directory, with whatever the library left beside it
        assert "shard-r000-writing/shard-r000-000002.safetensors.tmp" in leftovers
    if mode == "inside_library":  # the library's own partial file, wherever it writes it
        # the shard before may still have been committing (the commit thread overlaps the next write)
        assert len(committed.shards) in (1, 2) and leftovers - {Path(s.file).name for s in committed.shards}
    if mode == "after_rename":
        assert "shard-r000-000001.safetensors" in leftovers and len(committed.shards) == 1

    w = ShardWriter(out, SETTINGS, shard_rows=SHARD_ROWS)
    assert w.done_batches == committed.done_batches() and 0 < len(w.done_batches) < N_BATCHES
    assert {p.name for p in (out / "shards").iterdir()} == {Path(s.file).name for s in committed.shards}
    w.close()
    write_all(out)  # the same command again, completing the store

    crashed, ref = open_store(out, verify=True), open_store(store_dir)
    assert crashed.manifest.to_json() == ref.manifest.to_json()  # the same shards, bytes and checksums
    for name in ref.manifest.columns:
        assert torch.equal(bits(crashed.tensor(name)), bits(ref.tensor(name)))


def test_leftovers_of_a_crash_are_removed_on_resume(store_dir: Path):
    shards = store_dir / "shards"
    (shards / "shard-r000-000099.safetensors").write_bytes(b"never committed")
    (shards / "shard-r000-000099.safetensors.tmp").write_bytes(b"half written")
    (store_dir / "manifest.json.tmp").write_text("{")
    (shards / "shard-r001-000000.safetensors").write_bytes(b"another rank's: not ours to touch")
    before = Manifest.load(store_dir / "manifest.json")
    ShardWriter(store_dir, SETTINGS, shard_rows=SHARD_ROWS).close()
    assert sorted(p.name for p in shards.iterdir()) == sorted(
        [Path(s.file).name for s in before.shards] + ["shard-r001-000000.safetensors"]
    )
    assert not (store_dir / "manifest.json.tmp").exists()
    assert Manifest.load(store_dir / "manifest.json").to_json() == before.to_json()


def test_safetensors_temp_files_of_older_writers_are_removed_on_resume(tmp_path: Path):
    """Writers before the staging directories ran safetensors' save_file in shards/ itself, and a
    kill left its temporary file (`.tmp` + 6 letters or digits) there: the resume deletes it, and
    nothing of another name."""
    out = tmp_path / "old"
    write_all(out, batches=range(N_BATCHES // 2))
    shards = out / "shards"
    (shards / ".tmpCgbniX").write_bytes(b"half of a shard")
    (shards / ".tmpCgbni").write_bytes(b"not safetensors' name: 5 characters")
    (shards / "notes.tmpAbCdEf").write_bytes(b"not safetensors' name: a prefix")
    write_all(out)
    listed = [Path(s.file).name for s in Manifest.load(out / "manifest.json").shards]
    assert sorted(p.name for p in shards.iterdir()) == sorted([*listed, ".tmpCgbni", "notes.tmpAbCdEf"])
    store = open_store(out, verify=True)
    for name, column in expected_columns().items():
        assert torch.equal(bits(store.tensor(name)), bits(column)), name


def test_other_settings_are_refused_with_the_difference(store_dir: Path):
    changed = {**SETTINGS, "context": 16, "revision": "abc"}
    with pytest.raises(StoreError) as e:
        ShardWriter(store_dir, changed)
    msg = str(e.value)
    assert "context: stored 8, given 16" in msg and 'revision: stored (absent), given "abc"' in msg
    assert "new --out" in msg and "delete" in msg
    assert open_store(store_dir, verify=True).manifest.settings == SETTINGS  # untouched


def test_a_foreign_directory_is_refused(tmp_path: Path):
    (tmp_path / "thesis.tex").write_text("precious")
    with pytest.raises(StoreError, match="not a hookscope store"):
        ShardWriter(tmp_path, SETTINGS)


# -- failures while writing -----------------------------------------------------------------------


def test_full_disk_raises_and_keeps_what_was_committed(tmp_path: Path, store_dir: Path, monkeypatch):
    real_save, calls = writer_module.save_columns, []

    def save_columns(columns, path, *args, **kw):
        calls.append(path)
        if len(calls) == 3:
            Path(path).write_bytes(b"partial")  # what a full disk leaves behind
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(columns, path, *args, **kw)

    monkeypatch.setattr(writer_module, "save_columns", save_columns)
    out = tmp_path / "full"
    with pytest.raises(StoreError, match="No space left on device") as e:
        write_all(out)
    assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == errno.ENOSPC
    assert "2 shards already committed are intact" in str(e.value)
    store = open_store(out, verify=True)
    assert store.num_shards == 2 and not list((out / "shards").glob("*.tmp"))
    want = expected_columns(range(store.manifest.shards[-1].batch_end + 1))
    assert torch.equal(bits(store.tensor("blocks.1.resid_post")), bits(want["blocks.1.resid_post"]))

    monkeypatch.setattr(writer_module, "save_columns", real_save)  # space freed: the same command resumes
    write_all(out)
    assert open_store(out, verify=True).manifest.to_json() == open_store(store_dir).manifest.to_json()


def test_unwritable_directory_is_refused(tmp_path: Path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(StoreError, match="cannot create the store directory"):
        ShardWriter(blocker / "store", SETTINGS)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory_is_refused(tmp_path: Path):
    tmp_path.joinpath("ro").mkdir(mode=0o500)
    with pytest.raises(StoreError, match="writable"):
        ShardWriter(tmp_path / "ro" / "store", SETTINGS)


# -- corruption -----------------------------------------------------------------------------------


def test_verify_names_a_truncated_and_a_flipped_shard(store_dir: Path):
    m = Manifest.load(store_dir / "manifest.json")
    first, second = (store_dir / m.shards[0].file), (store_dir / m.shards[1].file)
    first.write_bytes(first.read_bytes()[:-10])
    data = bytearray(second.read_bytes())
    data[-5] ^= 0x01
    second.write_bytes(bytes(data))
    store = open_store(store_dir)
    with pytest.raises(StoreError) as e:
        store.verify()
    msg = str(e.value)
    assert "2 of 3 shards are damaged" in msg
    assert f"{m.shards[0].file}: {m.shards[0].bytes - 10} bytes" in msg
    assert f"{m.shards[1].file}: checksum (xxh3_128) differs" in msg
    with pytest.raises(StoreError, match="truncated"):
        store.shard(0)
    with pytest.raises(StoreError, match="damaged"):
        open_store(store_dir, verify=True)


def test_a_corrupt_header_is_an_error_not_a_crash(store_dir: Path):
    m = Manifest.load(store_dir / "manifest.json")
    path = store_dir / m.shards[0].file
    data = path.read_bytes()
    path.write_bytes((2**62).to_bytes(8, "little") + data[8:])  # header length far beyond the file
    with pytest.raises(StoreError, match="header length 4611686018427387904 does not fit"):
        open_store(store_dir).shard(0)
    # truncated, with a manifest that agrees on the size: the tensors' byte ranges run past the end
    path.write_bytes(data[:-40])
    raw = json.loads((store_dir / "manifest.json").read_text())
    raw["shards"][0]["bytes"] -= 40
    raw["bytes"] -= 40
    (store_dir / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(StoreError, match="outside the .* data bytes: truncated or corrupt"):
        open_store(store_dir).shard(0)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda raw: "{not json", "not readable JSON"),
        (lambda raw: {**raw, "rows": "many"}, "rows should be int"),
        (lambda raw: {**raw, "version": 99}, "format version 99"),
        (lambda raw: {**raw, "settings": {**raw["settings"], "context": 9}}, "settings_hash does not match"),
        (
            lambda raw: {
                **raw,
                "shards": [{**raw["shards"][0], "file": "../etc/passwd"}, *raw["shards"][1:]],
            },
            "should be shards/",
        ),
        (lambda raw: {k: v for k, v in raw.items() if k != "shards"}, "'shards'"),
    ],
)
def test_a_malformed_manifest_is_a_clear_error(store_dir: Path, edit, message):
    path = store_dir / "manifest.json"
    raw = json.loads(path.read_text())
    new = edit(raw)
    path.write_text(new if isinstance(new, str) else json.dumps(new))
    with pytest.raises(StoreError, match=message):
        open_store(store_dir)


def test_missing_store_and_missing_shard(tmp_path: Path, store_dir: Path):
    with pytest.raises(StoreError, match="no such store"):
        open_store(tmp_path / "nope")
    (store_dir / Manifest.load(store_dir / "manifest.json").shards[1].file).unlink()
    with pytest.raises(StoreError, match="1 shard file"):
        open_store(store_dir)


# -- torchrun: one writer per rank ----------------------------------------------------------------


def test_ranks_write_their_own_shards_and_merge_to_the_same_rows(tmp_path: Path, store_dir: Path):
    out = tmp_path / "ranks"
    for rank in (1, 0):  # in any order; each touches only its own files
        write_all(out, [i for i in range(N_BATCHES) if i % 2 == rank], rank=rank, world_size=2)
    with pytest.raises(StoreError, match="only per-rank manifests"):
        open_store(out)
    with pytest.raises(StoreError, match="belongs to rank 1"):  # (other world sizes: test_store_elastic.py)
        ShardWriter(out, SETTINGS, rank=0, world_size=2).write(13, *make_batch(13))
    merged = merge_rank_manifests(out, 2)
    assert {s.rank for s in merged.shards} == {0, 1}
    assert all(Path(s.file).name.startswith(f"shard-r{s.rank:03d}-") for s in merged.shards)
    assert merged.done_batches() == set(range(N_BATCHES))
    assert merged.done_batches(rank=1) == set(range(1, N_BATCHES, 2))
    both, one = open_store(out, verify=True), open_store(store_dir)
    assert len(both) == len(one)
    for name, stats in one.stats.items():  # merged sums agree up to the order of float additions
        assert (both.stats[name].nonfinite, both.stats[name].norm_count) == (
            stats.nonfinite,
            stats.norm_count,
        )
        assert both.stats[name].norm_sumsq == pytest.approx(stats.norm_sumsq, rel=1e-12)

    def rows(s):
        return sorted(
            zip(
                s.tensor("seq_ids").tolist(),
                s.tensor("positions").tolist(),
                s.tensor("blocks.1.resid_post").float().sum(1).tolist(),
                strict=True,
            )
        )

    assert rows(both) == rows(one)
    with ShardWriter(out, SETTINGS) as w:  # one process may take over: a new attempt with nothing to do
        assert (w.generation, w.done_batches) == (1, frozenset(range(N_BATCHES)))
    assert open_store(out, verify=True).manifest.shards == merged.shards


# -- the shuffled dataset -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def id_store(tmp_path_factory) -> object:
    """200 rows in 8 shards of 25; column "x" holds each row's own index."""
    out = tmp_path_factory.mktemp("ids") / "s"
    with ShardWriter(out, {"ids": True}, shard_rows=25) as w:
        for b in range(40):
            ids = torch.arange(b * 5, b * 5 + 5)
            w.write(b, {"x": ids.float()[:, None].repeat(1, 3)}, {"token_ids": ids})
    return open_store(out)


def ids_of(dataset) -> list[int]:
    out = []
    for item in dataset:
        x = item["x"] if isinstance(item, dict) else item
        out += x.reshape(-1, 3)[:, 0].long().tolist()
    return out


def test_shuffle_is_a_seeded_permutation_per_epoch(id_store):
    ds = id_store.dataset("x", seed=3, buffer_rows=60)
    epoch0, epoch1 = ids_of(ds), ids_of(ds)  # iterating again moves on to the next epoch
    assert sorted(epoch0) == sorted(epoch1) == list(range(200)) and len(ds) == 200
    assert epoch0 != list(range(200)) and epoch0 != epoch1
    assert ids_of(id_store.dataset("x", seed=3, buffer_rows=60)) == epoch0
    assert ids_of(id_store.dataset("x", seed=3, buffer_rows=60, epoch=1)) == epoch1
    assert ids_of(id_store.dataset("x", seed=4, buffer_rows=60)) != epoch0
    # several shards are interleaved in one window: the first 75 rows (3 shards) mix 3 shards
    assert len({i // 25 for i in epoch0[:75]}) == 3
    assert ids_of(id_store.dataset("x", shuffle=False)) == list(range(200))


def test_rows_come_with_their_other_columns_and_in_batches(id_store):
    rows = list(id_store.dataset(["x", "token_ids"], seed=1, buffer_rows=50))
    assert all(torch.equal(r["x"], r["token_ids"].float().repeat(3)) for r in rows)
    flat = ids_of(id_store.dataset("x", seed=1, buffer_rows=50))
    batched = list(id_store.dataset("x", seed=1, buffer_rows=50, batch_size=32))
    assert [b.shape for b in batched] == [(32, 3)] * 6 + [(8, 3)]
    # a batch holds its slice of the row-by-row stream (grouped by shard inside the batch)
    at = 0
    for b in batched:
        assert sorted(b[:, 0].long().tolist()) == sorted(flat[at : at + len(b)])
        at += len(b)
    assert len(id_store.dataset("x", batch_size=32, drop_last=True)) == 6
    assert len(list(id_store.dataset("x", batch_size=32, drop_last=True))) == 6


@pytest.mark.parametrize("k", [0, 1, 49, 50, 75, 137, 199, 200])
def test_restored_sampler_yields_exactly_the_rest_of_the_epoch(id_store, k: int):
    full = ids_of(id_store.dataset("x", seed=7, buffer_rows=50, epoch=2))
    ds = id_store.dataset("x", seed=7, buffer_rows=50, epoch=2)
    seen = []
    for _, row in zip(range(k), ds, strict=False):  # deliberately stops after k rows of ds
        seen.append(int(row[0]))
    state = ds.state_dict()
    fresh = id_store.dataset("x", seed=7, buffer_rows=50)
    fresh.load_state_dict(json.loads(json.dumps(state)))  # survives a checkpoint file
    assert seen + ids_of(fresh) == full
    # the epoch is spent (at k == 200 only once that iteration ends): the next one is epoch 3's order
    assert ids_of(fresh) == ids_of(id_store.dataset("x", seed=7, buffer_rows=50, epoch=3))


def test_restored_sampler_in_batches_and_per_rank(id_store):
    def make():
        return id_store.dataset("x", seed=5, buffer_rows=40, batch_size=16, rank=1, world_size=3)

    full = ids_of(make())
    ds = make()
    first = [next(iter(ds)) for _ in range(2)]  # each iter() continues from the cursor
    fresh = make()
    fresh.load_state_dict(ds.state_dict())
    assert ids_of(first) + ids_of(fresh) == full
    with pytest.raises(StoreError, match="rank=1"):
        id_store.dataset("x", seed=5, rank=2, world_size=3).load_state_dict(ds.state_dict())


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_cover_every_row_exactly_once(id_store, world_size: int):
    parts = [
        ids_of(id_store.dataset("x", seed=2, buffer_rows=60, rank=r, world_size=world_size))
        for r in range(world_size)
    ]
    assert sorted(i for part in parts for i in part) == list(range(200))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert [len(id_store.dataset("x", rank=r, world_size=world_size)) for r in range(world_size)] == list(
        map(len, parts)
    )


def test_train_and_val_split_rows_and_do_not_depend_on_the_seed(id_store):
    train = ids_of(id_store.dataset("x", split="train", val_fraction=0.2, seed=0, buffer_rows=60))
    val = ids_of(id_store.dataset("x", split="val", val_fraction=0.2, seed=0, buffer_rows=60))
    assert sorted(train + val) == list(range(200)) and 20 <= len(val) <= 60
    assert sorted(val) == sorted(ids_of(id_store.dataset("x", split="val", val_fraction=0.2, seed=9)))
    assert len(id_store.dataset("x", split="val", val_fraction=0.2)) == len(val)
    with pytest.raises(StoreError, match="split="):
        id_store.dataset("x", split="test")


def test_unknown_column_is_refused_and_workers_share_the_rows(id_store):
    with pytest.raises(StoreError, match="no column 'y'"):
        id_store.dataset("y")
    for workers in (0, 1, 2):  # the main process, or worker processes: every row once
        loader = torch.utils.data.DataLoader(
            id_store.dataset("x", batch_size=10), batch_size=None, num_workers=workers
        )
        assert sorted(ids_of(loader)) == list(range(200))


def test_hugging_face_export(id_store, tmp_path: Path):
    from hookscope.export import to_hf_dataset

    ds = to_hf_dataset(id_store, ["x", "token_ids"], cache_dir=str(tmp_path / "hf"))
    assert ds.num_rows == 200
    assert ds["token_ids"] == list(range(200))
    assert np.array_equal(np.array(ds["x"]), id_store.to_numpy("x"))
