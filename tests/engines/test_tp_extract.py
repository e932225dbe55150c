"""`hookscope extract --tp N` in ranks with torchrun's environment (gloo on the CPU): TP=2 (2
processes) and TP=2 x DP=2 (4 processes) against one unsharded process's extraction of the same
corpus, in float32; a rank killed mid-run and the run resumed, with another data-parallel width
and with another TP width.

Tolerance against the unsharded process: atol 1e-6, rtol 1e-5 (the differences seen are <= 1e-7:
the all-reduce sums the ranks' halves in another order than one matmul, so the rows are not
bit-equal to it). Between runs of the same TP width they are bit-equal: the deal does not change
what a batch computes.

The ranks are children of the fork server with torchrun's environment for their rank
(tests/kit/forkserver.py, `call_ranks`: the first that fails gets the others killed, as torchrun
does); tests/engines/test_tensor_parallel.py launches torchrun itself.
"""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest
import torch
from elastic_kit import RUN_CLI, assert_same_rows_as, in_batch_order, run_ranks
from forkserver import ForkServer

import hookscope as hs
from hookscope.extract import ExtractConfig, extract
from hookscope.store import open_store
from hookscope.testing import save_tiny

POINTS = ["blocks.1.attn.z", "blocks.1.mlp.post", "blocks.2.resid_post"]  # two sharded, one whole
TOL = {"atol": 1e-6, "rtol": 1e-5}


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama (4 heads, 2 kv heads) with a tokenizer, a corpus of 40 lines, and the store of
    one unsharded process (the reference)."""
    root = tmp_path_factory.mktemp("tpx")
    model = save_tiny("llama", root / "llama", d_model=64, n_layers=3, n_heads=4, context=64)
    rng = random.Random(0)
    words = "the a model layer head token sum rank shard group batch row store".split()
    lines = (" ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) for _ in range(40))
    (root / "corpus.txt").write_text("\n".join(lines) + "\n")
    paths = {"root": root, "model": model, "corpus": root / "corpus.txt", "reference": root / "reference"}
    extract(ExtractConfig(**config(paths, paths["reference"]), progress=False))
    return paths


def config(paths: dict[str, Path], out: Path) -> dict:
    return {
        "out": str(out),
        "model": str(paths["model"]),
        "data": str(paths["corpus"]),
        "points": POINTS,
        "context": 16,
        "batch_size": 2,
        "dtype": "float32",
        "shard_rows": 32,  # about a shard per batch: a kill finds some committed, some not
    }


def cli(paths: dict[str, Path], out: Path, tp: int) -> list[str]:
    args = ["extract", str(paths["model"]), "--out", str(out), "--data", str(paths["corpus"])]
    args += ["--points", ",".join(POINTS), "--context", "16", "--batch-size", "2", "--dtype", "float32"]
    return args + ["--shard-rows", "32", "--no-progress"] + (["--tp", str(tp)] if tp > 1 else [])


@pytest.fixture(scope="module")
def server() -> ForkServer:
    return ForkServer.shared()


def extract_in_ranks(server: ForkServer, paths: dict[str, Path], name: str, nproc: int, tp: int) -> Path:
    out = paths["root"] / name
    run_ranks(server, nproc, cli(paths, out, tp))
    return out


def kill_one_rank(server: ForkServer, nproc: int, kill_rank: int, kill_at: str, args: list[str]) -> None:
    """`hookscope args...` on `nproc` ranks, rank `kill_rank` SIGKILLed at `kill_at`."""
    ranks = server.call_ranks(
        nproc, "tp_extract_worker:run_rank", kill_rank=kill_rank, kill_at=kill_at, args=args
    )
    assert ranks[kill_rank].status == -signal.SIGKILL, [r.log[-3000:] for r in ranks]


@pytest.fixture(scope="module")
def tp2(setup, server) -> Path:
    return extract_in_ranks(server, setup, "tp2", 2, tp=2)


@pytest.fixture(scope="module")
def tp2_dp2(setup, server) -> Path:
    return extract_in_ranks(server, setup, "tp2_dp2", 4, tp=2)


def assert_rows_close(got_path: Path, want_path: Path) -> None:
    """The same rows as `want` (row for row in batch order: token, position, sequence equal; the
    activations to TOL), each exactly once."""
    got, want = in_batch_order(open_store(got_path, verify=True)), in_batch_order(open_store(want_path))
    assert got.keys() == want.keys()
    pairs = torch.stack([got["seq_ids"], got["positions"]], 1)
    assert len(torch.unique(pairs, dim=0)) == len(pairs) > 0  # no row twice
    for name in ("token_ids", "positions", "seq_ids", "doc_ids"):
        assert torch.equal(got[name], want[name]), name
    for name in POINTS:
        assert got[name].abs().max() > 0.1, name  # values there to get wrong
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow  # 2 or 4 ranks, each loading the model
def test_tp2_rows_equal_one_unsharded_process(setup, tp2):
    assert_rows_close(tp2, setup["reference"])
    m = open_store(tp2).manifest
    assert m.world_size == 1  # one tensor-parallel group: one writer, one manifest
    assert sorted(b for s in m.shards for b in s.batch_indices()) == list(range(1 + max(m.done_batches())))
    assert not list(tp2.glob("manifest.rank*"))


@pytest.mark.slow  # 2 or 4 ranks, each loading the model
def test_tp2_dp2_rows_equal_one_unsharded_process(setup, tp2, tp2_dp2):
    assert_rows_close(tp2_dp2, setup["reference"])
    m = open_store(tp2_dp2).manifest
    assert m.world_size == 2  # two groups deal the batches, as two data-parallel ranks do
    assert {s.rank for s in m.shards} == {0, 1}
    assert sorted(b for s in m.shards for b in s.batch_indices()) == list(range(1 + max(m.done_batches())))
    # the same TP width computes each batch the same way, whichever group runs it: bit for bit
    a, b = in_batch_order(open_store(tp2_dp2)), in_batch_order(open_store(tp2))
    for name in POINTS:
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


@pytest.mark.slow  # 2 or 4 ranks, each loading the model
def test_a_writer_killed_under_tp2_dp2_resumed_with_one_group(setup, tp2, server):
    """Rank 2 (the second group's writer) SIGKILLed after its second shard's commit; the rest are
    stopped, as torchrun stops them. Resumed with 2 processes (one group: another data-parallel
    width), the batches not committed are dealt again: the store is the uninterrupted TP=2 run's,
    bit for bit."""
    out = setup["root"] / "killed_dp"
    kill_one_rank(server, 4, 2, "manifest-replace:3:after", cli(setup, out, 2))
    run_ranks(server, 2, cli(setup, out, 2))
    assert_same_rows_as(out, tp2, first=2, then=1)


@pytest.mark.slow  # 2 or 4 ranks, each loading the model
def test_a_resume_with_another_tp_width_is_allowed(setup, tp2, server):
    """TP=2, its second rank SIGKILLed mid-forward; resumed by one plain process (no --tp): the rows
    committed before the kill stay as TP=2 wrote them, the rest are the unsharded process's."""
    out = setup["root"] / "killed_tp"
    kill_one_rank(server, 2, 1, "forward:700", cli(setup, out, 2))
    kept = len(open_store(out))  # one writer writes in batch order: these are the first rows
    plain = server.call(RUN_CLI, args=cli(setup, out, 1), signal_name="KILL", kill_at="never")
    assert plain.status == 0 and plain.result["code"] == 0, plain.log[-3000:]
    got = in_batch_order(open_store(out, verify=True))
    sharded, unsharded = in_batch_order(open_store(tp2)), in_batch_order(open_store(setup["reference"]))
    assert 0 < kept < len(got["token_ids"]) == len(unsharded["token_ids"])
    for name in got:
        assert torch.equal(got[name][:kept], sharded[name][:kept]), name
        assert torch.equal(got[name][kept:], unsharded[name][kept:]), name


# -- bad input, refused before anything is written (no torchrun needed) ----------------------------


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"tp": 0}, "--tp 0: must be a whole number"),
        ({"tp": 2, "max_memory": "1GiB"}, "does not combine with --tp"),
        ({"tp": 2, "device_map": "auto"}, "does not combine with device_map="),  # hs.load's refusal
        ({"tp": 3}, "does not divide the model's num_attention_heads"),
        ({"tp": 2}, "torchrun --nproc_per_node 2"),  # not under torchrun
    ],
)
def test_bad_tp_refused_before_anything_is_written(setup, settings, match, monkeypatch, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "store"
    with pytest.raises(hs.HookscopeError, match=match):
        extract(ExtractConfig(**{**config(setup, out), **settings}))
    assert not out.exists()


def test_a_family_with_no_plan_refused(tiny_dirs, tmp_path):
    out = tmp_path / "store"
    with pytest.raises(hs.TensorParallelError, match="no tensor-parallel plan for 'gpt2'"):
        extract(ExtractConfig(out=str(out), model=str(tiny_dirs["gpt2"]), tp=2))
    assert not out.exists()


def test_the_cli_passes_tp_on(setup, tmp_path, capsys):
    from hookscope.cli import main

    assert main(cli(setup, tmp_path / "store", 3)) == 2
    assert "tp=3 does not divide the model's num_attention_heads" in capsys.readouterr().err
