"""`hookscope extract --engine vllm` and `ExtractConfig(engine=...)`: the store a vLLM engine writes
holds the rows of hookscope's Hugging Face extraction of the same checkpoint and corpus; a command
interrupted (Ctrl-C), run again and killed (SIGKILL), then resumed gives the store of one
uninterrupted run; a second run on a store being written is refused; what the engine path refuses,
before any engine starts.

Three engines: one made here, shared (given to `ExtractConfig(engine=llm)`, with the settings the
command makes its own engine with), and one per command run in a child process. The interrupted
command's engine has vLLM's default layout (engine core and worker processes, which it must stop on
Ctrl-C); the shared one and the killed command's run their engine core in their own process
(vllm_models.IN_PROCESS: each start a fraction of the default layout's), which the resumed store,
byte for byte the uninterrupted one, shows computes the same rows.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from faultkit import compare_stores
from gate import need

vllm = need("vllm")

from vllm_models import IN_PROCESS, assert_close, in_this_process, save, shut  # noqa: E402

import hookscope as hs  # noqa: E402
from hookscope.engines import vllm as hv  # noqa: E402
from hookscope.errors import EngineError, HookscopeError, StoreError, UnknownPointError  # noqa: E402

CONTEXT, BATCH, SHARD_ROWS = 64, 4, 256
POINTS = ["blocks.*.resid_post", "blocks.0.attn.z", "blocks.1.mlp.post"]
# one batch per engine call (its sequences are the engine's max_num_seqs): an interrupt lands between calls
ENGINE_ARG = f"max_num_seqs={BATCH}"
SRC = str(Path(hs.__file__).parents[1])


@dataclass
class Case:
    root: Path
    model: Path
    corpus: Path


def _corpus(path: Path) -> Path:
    words = "the a fox dog ran over under river stone light small large quick slow".split()
    g = torch.Generator().manual_seed(3)
    docs = []
    for i in range(120):
        picks = torch.randint(0, len(words), (int(torch.randint(20, 90, (1,), generator=g)),), generator=g)
        docs.append(f"Document {i}: " + " ".join(words[j] for j in picks.tolist()) + ".")
    path.write_text("\n\n".join(docs))
    return path


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> Case:
    root = tmp_path_factory.mktemp("vllm-extract")
    return Case(root, save("llama", root / "llama", seed=1), _corpus(root / "corpus.txt"))


@pytest.fixture(scope="module")
def llm(case):
    """The engine `--engine vllm --engine-arg max_num_seqs=4` makes (served.py's defaults), so that
    its rows are the command's."""
    with in_this_process():
        engine = hv.llm(
            str(case.model), max_model_len=CONTEXT + 1, enable_prefix_caching=False, max_num_seqs=BATCH
        )
    yield engine
    shut(engine)


def config(case: Case, out: Path, **options) -> hs.ExtractConfig:
    """The run every test makes, `options` changed."""
    fields = {
        "out": str(out),
        "model": str(case.model),
        "points": POINTS,
        "data": str(case.corpus),
        "context": CONTEXT,
        "batch_size": BATCH,
        "dtype": "float32",
        "shard_rows": SHARD_ROWS,
        "progress": False,
    }
    return hs.ExtractConfig(**{**fields, **options})


@pytest.fixture(scope="module")
def reference(case, llm) -> Path:
    """One uninterrupted run on the shared engine."""
    out = case.root / "reference"
    hs.extract(config(case, out, engine=llm))
    return out


@pytest.mark.slow
def test_the_store_holds_hugging_face_extractions_rows(case, reference):
    hf = case.root / "hugging-face"
    hs.extract(config(case, hf))
    served, want = hs.open_store(reference), hs.open_store(hf)
    assert len(served) == len(want) > 40 * CONTEXT
    assert served.manifest.settings == want.manifest.settings  # the same store: it resumes either way
    assert set(served.manifest.columns) == set(want.manifest.columns)
    for name in want.manifest.columns:
        got, ref = served.tensor(name), want.tensor(name)
        if ref.is_floating_point():
            assert got.dtype == ref.dtype == torch.float32
            # float32 sums in another order: ~1e-6 of the largest value, measured
            assert_close(got, ref, f"{name}, vLLM store vs Hugging Face store")
        else:  # token ids, documents, positions, sequences: the same rows in the same order
            assert torch.equal(got, ref), name


def _command(case: Case, out: Path, log: Path, env: dict | None = None) -> subprocess.Popen:
    """`hookscope extract --engine vllm` in a process group of its own (its engine's processes too),
    `env` added to its environment."""
    args = [
        *("extract", str(case.model), "--engine", "vllm", "--engine-arg", ENGINE_ARG, "--out", str(out)),
        *("--points", ",".join(POINTS), "--data", str(case.corpus), "--context", str(CONTEXT)),
        *("--batch-size", str(BATCH), "--dtype", "float32", "--shard-rows", str(SHARD_ROWS), "--no-progress"),
    ]
    env = {**os.environ, "PYTHONPATH": SRC, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    with log.open("w") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "_hookscope_cli", *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )


def _kill_group(run: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # nothing left of it
        os.killpg(run.pid, signal.SIGKILL)


def _committed(out: Path) -> int:
    return len(list((out / "shards").glob("shard-*.safetensors"))) if (out / "shards").is_dir() else 0


def _wait_for_shards(run: subprocess.Popen, out: Path, shards: int, log: Path) -> None:
    deadline = time.monotonic() + 400
    while _committed(out) < shards:
        assert run.poll() is None, f"the command ended ({run.returncode}) early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "no shards within 400 s"
        time.sleep(0.05)


@pytest.mark.slow
def test_interrupted_then_killed_then_resumed_is_the_uninterrupted_store(case, llm, reference, tmp_path):
    out, log = tmp_path / "store", tmp_path / "command.log"
    total = len(hs.open_store(reference))

    first = _command(case, out, log)
    try:
        _wait_for_shards(first, out, 2, log)
        # SIGINT to the command alone (`kill -INT`); a terminal's Ctrl-C reaches the engine's processes
        # too, whose core may then die mid-call (not covered here)
        first.send_signal(signal.SIGINT)
        assert first.wait(120) == 130, log.read_text()[-3000:]
    finally:
        _kill_group(first)  # what is left of its engine
    interrupted = len(hs.open_store(out))
    assert 2 * SHARD_ROWS <= interrupted < total

    second = _command(case, out, log, env=IN_PROCESS)
    try:
        _wait_for_shards(second, out, _committed(out) + 2, log)
        # a second run on the store while this one writes: refused, nothing of it written
        with pytest.raises(StoreError, match="another run|changed while this run started"):
            hs.extract(config(case, out, engine=llm))
    finally:
        _kill_group(second)  # the command and its engine, at once
        second.wait(60)

    hs.extract(config(case, out, engine=llm))  # the same run resumed, here
    compared = compare_stores(out, reference)
    assert compared["rows"] == total and compared["rows_lost"] == compared["rows_duplicated"] == 0
    # the engine's rows are deterministic for the same batches: the same bytes
    assert compared["same_values"] and compared["same_files"], compared


# -- refused before any work -------------------------------------------------------------------------


def test_a_point_vllm_never_exposes_is_refused_before_the_engine_starts(case, tmp_path):
    with pytest.raises(UnknownPointError, match="attn.pattern.*never materialise"):
        hs.extract(config(case, tmp_path / "s", engine="vllm", points=["blocks.0.attn.pattern"]))
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"engine_args": {"tensor_parallel_size": 2}}, "tensor_parallel_size=2.*not supported"),
        ({"engine_args": {"enforce_eager": False}}, "compiled graphs"),
        ({"engine_args": {"worker_extension_cls": "x"}}, "sets it itself"),
        ({"data": "images:/nowhere", "context": None}, "extracts text"),
    ],
)
def test_engine_options_that_cannot_work_are_refused(case, tmp_path, options, message):
    with pytest.raises(HookscopeError, match=message):
        hs.extract(config(case, tmp_path / "s", engine="vllm", **options))
    assert not (tmp_path / "s").exists()


def test_a_given_engine_must_be_hookscopes_and_long_enough(case, llm, tmp_path):
    with pytest.raises(EngineError, match="not a vLLM engine"):
        hs.extract(config(case, tmp_path / "s", engine=object()))
    with pytest.raises(HookscopeError, match="is not the given engine's model"):
        hs.extract(config(case, tmp_path / "s", engine=llm, model=str(tmp_path)))
    with pytest.raises(EngineError, match="max_model_len 65 is shorter"):
        hs.extract(config(case, tmp_path / "s", engine=llm, context=128))
    assert not (tmp_path / "s").exists()
