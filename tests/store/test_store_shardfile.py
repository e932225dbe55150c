"""The shard file writer (store/shardfile.py) writes the bytes safetensors' own save_file writes,
byte for byte, from columns given as several parts, and its checksum is that of those bytes."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import save_file

from hookscope.store.shardfile import DTYPES, save_columns, write_shard_file


def columns() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for i, dtype in enumerate(DTYPES):  # every dtype, named so that names and dtypes sort apart
        values = (
            torch.randint(0, 100, (7, 3), generator=g)
            if not dtype.is_floating_point
            else torch.randn(7, 3, generator=g) * 5
        )
        out[f'c{len(DTYPES) - i:02d}-ü "q"\\'] = values.to(dtype)
    out["wide"] = torch.randn(7, 300, 5, generator=g).to(torch.bfloat16)
    out["token_ids"] = torch.arange(7)
    out["empty"] = torch.zeros(7, 0)
    return out


@pytest.mark.parametrize("metadata", [None, {"hookscope.shard": "batches 0-3/2 of rank 1, settings ab"}])
@pytest.mark.parametrize("threads", [0, 3])
def test_the_bytes_are_those_safetensors_writes(tmp_path: Path, metadata, threads: int):
    whole = columns()
    save_file(whole, tmp_path / "library.safetensors", metadata=metadata)
    want = (tmp_path / "library.safetensors").read_bytes()
    parts = {k: [v[:2], v[2:3], v[3:]] for k, v in whole.items()}  # rows split across three batches
    pool = ThreadPoolExecutor(threads) if threads else None
    size, digest = write_shard_file(parts, tmp_path / "ours.safetensors", metadata, "xxh3_128", pool)
    got = (tmp_path / "ours.safetensors").read_bytes()
    assert got == want
    assert (size, digest) == (len(want), xxhash.xxh3_128(want).hexdigest())


def test_a_shard_larger_than_one_piece_is_written_whole(tmp_path: Path):
    big = {"p": [torch.randn(3000, 2000).to(torch.bfloat16), torch.randn(1000, 2000).to(torch.bfloat16)]}
    with ThreadPoolExecutor(2) as pool:
        size, digest = write_shard_file(big, tmp_path / "s", None, "sha256", pool)
    save_file({"p": torch.cat(big["p"])}, tmp_path / "ref")
    data = (tmp_path / "s").read_bytes()
    assert data == (tmp_path / "ref").read_bytes()
    assert (size, digest) == (len(data), hashlib.sha256(data).hexdigest())


def test_a_dtype_it_does_not_write_goes_through_safetensors(tmp_path: Path):
    odd = {"p": [torch.zeros(4, 2, dtype=torch.float8_e4m3fnuz)], "token_ids": [torch.arange(4)]}
    size, digest = save_columns(odd, tmp_path / "s", {"k": "v"}, "xxh3_128")
    data = (tmp_path / "s").read_bytes()
    save_file({k: v[0] for k, v in odd.items()}, tmp_path / "ref", metadata={"k": "v"})
    assert data == (tmp_path / "ref").read_bytes()
    assert (size, digest) == (len(data), xxhash.xxh3_128(data).hexdigest())
