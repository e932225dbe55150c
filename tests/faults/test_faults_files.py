"""Hostile files: damaged, lying or swapped stores must give a clear StoreError from the reader and
exit code 2 with a message from `hookscope inspect`; never a crash, a hang or a huge allocation.

Each case is read in its own fork-server child (so a crash or a hang is caught and named) under an
address-space limit of 1 GiB beyond what the process already holds. Most header cases also rewrite
the manifest to agree with the damaged file (size and checksum), as an attacker or a buggy tool
would: then only the structural checks stand between the file and the reader.
test_store.py already covers a truncated and a bit-flipped shard against an honest manifest, a header
length of 2**62 and six malformed manifests; this file covers the rest.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import xxhash
from fault_log import record
from forkserver import ForkServer

from hookscope.store import ShardWriter

RESID = "blocks.1.resid_post"
POINTS = {RESID: ((6,), torch.bfloat16), "blocks.1.attn.z": ((2, 3), torch.float16)}


def write_store(out: Path, seed: int) -> Path:
    """3 shards of 2 batches of 10 rows; another seed gives other values in the same layout."""
    g = torch.Generator().manual_seed(seed)
    with ShardWriter(out, {"model": "tiny", "seed": seed}, shard_rows=20) as w:
        for b in range(6):
            acts = {k: torch.randn(10, *shape, generator=g).to(dtype) for k, (shape, dtype) in POINTS.items()}
            meta = {
                "token_ids": torch.randint(0, 500, (10,), generator=g),
                "positions": torch.arange(10),
                "doc_ids": torch.full((10,), b),
                "seq_ids": torch.full((10,), b),
            }
            w.write(b, acts, meta)
    return out


# -- tools to damage a store ----------------------------------------------------------------------


def manifest(store: Path) -> dict:
    return json.loads((store / "manifest.json").read_text())


def save_manifest(store: Path, raw: dict) -> None:
    raw["rows"] = sum(s["rows"] for s in raw["shards"])
    raw["bytes"] = sum(s["bytes"] for s in raw["shards"])
    (store / "manifest.json").write_text(json.dumps(raw))


def shard(store: Path, i: int = 1) -> Path:
    return store / manifest(store)["shards"][i]["file"]


def agree(store: Path, i: int = 1) -> None:
    """Make the manifest vouch for shard i as it now is: its size and checksum."""
    raw = manifest(store)
    data = shard(store, i).read_bytes()
    raw["shards"][i].update(bytes=len(data), xxh3_128=xxhash.xxh3_128(data).hexdigest())
    save_manifest(store, raw)


def read_parts(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def write_raw_header(path: Path, header: bytes, body: bytes, length: int | None = None) -> None:
    header += b" " * (-len(header) % 8)
    path.write_bytes((len(header) if length is None else length).to_bytes(8, "little") + header + body)


def edit_header(fn: Callable[[dict], object]) -> Callable[[Path, Path], None]:
    """A case that edits shard 1's JSON header in place and has the manifest agree."""

    def case(store: Path, other: Path) -> None:
        header, body = read_parts(shard(store))
        fn(header)
        write_raw_header(shard(store), json.dumps(header).encode(), body)
        agree(store)

    return case


def raw_header(header: bytes, length: int | None = None) -> Callable[[Path, Path], None]:
    def case(store: Path, other: Path) -> None:
        write_raw_header(shard(store), header, read_parts(shard(store))[1], length)
        agree(store)

    return case


def header_length(value: int) -> Callable[[Path, Path], None]:
    def case(store: Path, other: Path) -> None:
        data = shard(store).read_bytes()
        shard(store).write_bytes(value.to_bytes(8, "little") + data[8:])
        agree(store)

    return case


def truncate(keep: Callable[[int, int], int], *, agreed: bool) -> Callable[[Path, Path], None]:
    """keep(file size, header end) -> how many bytes to keep."""

    def case(store: Path, other: Path) -> None:
        data = shard(store).read_bytes()
        shard(store).write_bytes(data[: keep(len(data), 8 + int.from_bytes(data[:8], "little"))])
        if agreed:
            agree(store)

    return case


def lie(fn: Callable[[dict], object]) -> Callable[[Path, Path], None]:
    """A case where the shards are intact and the manifest lies (its totals kept consistent)."""

    def case(store: Path, other: Path) -> None:
        raw = manifest(store)
        fn(raw)
        save_manifest(store, raw)

    return case


def tensor(name: str, **changes) -> Callable[[dict], None]:
    return lambda h: h[name].update(changes)


def offsets(name: str, change: Callable[[list], list]) -> Callable[[dict], None]:
    return lambda h: h[name].update(data_offsets=change(h[name]["data_offsets"]))


def overlap(h: dict) -> None:
    h["positions"]["data_offsets"] = list(h["token_ids"]["data_offsets"])  # same size: both in bounds


def special_file(make: Callable[[Path], None]) -> Callable[[Path, Path], None]:
    """Shard 1 replaced by something that is not a regular file, which the manifest vouches for as
    an empty shard: reading a FIFO or /dev/zero to its end would never return."""

    def case(store: Path, other: Path) -> None:
        path = shard(store)
        path.unlink()
        make(path)
        raw = manifest(store)
        raw["shards"][1].update(bytes=0, rows=0, xxh3_128=xxhash.xxh3_128(b"").hexdigest())
        save_manifest(store, raw)

    return case


def swap_with_other(*, agreed: bool) -> Callable[[Path, Path], None]:
    def case(store: Path, other: Path) -> None:
        shutil.copyfile(shard(other), shard(store))
        if agreed:
            agree(store)

    return case


def swap_within(store: Path, other: Path) -> None:
    a, b = shard(store, 0), shard(store, 1)
    data = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(data)


def deep_manifest(store: Path, other: Path) -> None:
    (store / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)


def big_number_manifest(store: Path, other: Path) -> None:
    text = (store / "manifest.json").read_text()
    (store / "manifest.json").write_text(text.replace('"world_size": 1', '"world_size": ' + "9" * 5000))


# name -> (damage, whether the plain reader must refuse too: a checksum lie over intact data can
# only be seen by hashing, which verify() and inspect do)
CASES: dict[str, tuple[Callable[[Path, Path], None], bool]] = {
    "truncated to 0 bytes": (truncate(lambda size, h: 0, agreed=False), True),
    "truncated inside the header length": (truncate(lambda size, h: 5, agreed=False), True),
    "truncated inside the header, manifest agrees": (truncate(lambda size, h: h - 7, agreed=True), True),
    "truncated inside the data, manifest agrees": (
        truncate(lambda size, h: (size + h) // 2, agreed=True),
        True,
    ),
    "bytes appended after the data, manifest agrees": (
        lambda s, o: (shard(s).write_bytes(shard(s).read_bytes() + b"\0" * 64), agree(s)),
        True,
    ),
    "header length 2**64-1": (header_length(2**64 - 1), True),
    "header length one past the end": (lambda s, o: header_length(shard(s).stat().st_size - 7)(s, o), True),
    "header length 0": (header_length(0), True),
    "header not JSON": (raw_header(b"{not json at all"), True),
    "header not UTF-8": (raw_header(b'{"\xff\xfe": 1}'), True),
    "header a JSON list": (raw_header(b"[1, 2, 3]"), True),
    "header nested 100,000 deep": (raw_header(b"[" * 100_000 + b"]" * 100_000), True),
    "header with a 5,000-digit number": (raw_header(b'{"x": ' + b"9" * 5000 + b"}"), True),
    "tensor entry not an object": (edit_header(lambda h: h.update(token_ids=5)), True),
    "offsets past the end": (edit_header(offsets("seq_ids", lambda o: [0, 10**6])), True),
    "offsets beyond 64 bits": (edit_header(offsets("seq_ids", lambda o: [2**70, 2**70 + 80])), True),
    "offsets overlapping": (edit_header(overlap), True),
    "offsets reversed": (edit_header(offsets("seq_ids", lambda o: o[::-1])), True),
    "offsets negative": (edit_header(offsets("seq_ids", lambda o: [-80, 0])), True),
    "offsets fractional": (edit_header(offsets("seq_ids", lambda o: [0.5, 80.5])), True),
    "shape huge": (edit_header(tensor(RESID, shape=[2**40, 6])), True),
    "shape overflowing 64 bits": (edit_header(tensor(RESID, shape=[2**32, 2**32, 2**32])), True),
    "shape negative": (edit_header(tensor(RESID, shape=[-20, 6])), True),
    "dtype unknown": (edit_header(tensor(RESID, dtype="Q7")), True),
    "dtype reinterpreted (BF16 read as F16)": (edit_header(tensor(RESID, dtype="F16")), True),
    "shape transposed": (edit_header(tensor(RESID, shape=[6, 20])), True),
    "a column missing": (edit_header(lambda h: h.pop("seq_ids")), True),
    "metadata not strings": (edit_header(lambda h: h.update(__metadata__={"a": 1})), True),
    "shard is a FIFO, manifest agrees": (special_file(lambda p: os.mkfifo(p)), True),
    "shard is a link to /dev/zero, manifest agrees": (
        special_file(lambda p: p.symlink_to("/dev/zero")),
        True,
    ),
    "shard is a directory": (special_file(lambda p: p.mkdir()), True),
    "manifest: a shard's rows too many": (lie(lambda m: m["shards"][1].update(rows=25)), True),
    "manifest: a shard's rows too few": (lie(lambda m: m["shards"][1].update(rows=15)), True),
    "manifest: a shard's rows 10**15": (lie(lambda m: m["shards"][1].update(rows=10**15)), True),
    "manifest: a shard's bytes wrong": (
        lie(lambda m: m["shards"][1].update(bytes=m["shards"][1]["bytes"] + 8)),
        True,
    ),
    "manifest: a shard's checksum wrong": (lie(lambda m: m["shards"][1].update(xxh3_128="0" * 32)), False),
    "manifest: a point's shape wrong": (lie(lambda m: m["points"][RESID].update(shape=[7])), True),
    "manifest: a point's shape 10**12": (lie(lambda m: m["points"][RESID].update(shape=[10**12])), True),
    "manifest: a point's dtype wrong": (lie(lambda m: m["points"][RESID].update(dtype="float32")), True),
    "manifest: a dtype that is no dtype": (lie(lambda m: m["meta"]["token_ids"].update(dtype="os")), True),
    "manifest: no shards, and a dtype that is no dtype": (
        lie(lambda m: (m.update(shards=[]), m["points"][RESID].update(dtype="os"))),
        True,
    ),
    "manifest: a shard's batches wrong": (lie(lambda m: m["shards"][1].update(batches=[[0, 1, 1]])), True),
    "manifest nested 100,000 deep": (deep_manifest, True),
    "manifest with a 5,000-digit number": (big_number_manifest, True),
    "shard swapped with another store's": (swap_with_other(agreed=False), True),
    "shard swapped with another store's, manifest agrees": (swap_with_other(agreed=True), True),
    "two shards of one store exchanged": (swap_within, True),
}


@pytest.fixture(scope="module")
def server() -> ForkServer:
    return ForkServer.shared()


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hostile")
    return write_store(root / "good", seed=0), write_store(root / "other", seed=1)


@pytest.mark.slow
def test_the_intact_store_reads_cleanly(stores, server):
    reply = server.call("faultkit:probe_store", path=str(stores[0]))
    assert reply.status == 0, reply.log[-3000:]
    assert reply.result["reader"] == reply.result["verify"] == "ok"
    assert reply.result["inspect"] == "0: "


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_a_hostile_store_is_a_clear_error(case, stores, server, tmp_path):
    damage, reader_refuses = CASES[case]
    store = tmp_path / "store"
    shutil.copytree(stores[0], store)
    damage(store, stores[1])
    reply = server.call("faultkit:probe_store", path=str(store), timeout=60)
    result = reply.result or {}
    reader = result.get("reader", f"no result: exit status {reply.status}, timed out {reply.timed_out}")
    clear = [
        reply.status == 0,  # no crash, no hang, no allocation beyond the limit
        reader.startswith("StoreError: ") if reader_refuses else reader == "ok",
        result.get("verify", "").startswith("StoreError: "),
        result.get("inspect", "").startswith("2: hookscope: error: "),
    ]
    record("files", case, survived=int(all(clear)))
    assert reply.status == 0, (reply.timed_out, reply.log[-3000:])
    assert reader.startswith("StoreError: ") if reader_refuses else reader == "ok", reader
    assert result["verify"].startswith("StoreError: "), result["verify"]
    assert result["inspect"].startswith("2: hookscope: error: "), result["inspect"]
    assert str(store) in result["inspect"]  # the message says which store (and shard) is at fault
