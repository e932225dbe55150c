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


# 40 documents: ~6,500 rows, 13 shards; the commands are stopped after 2 and about 5 of them
DOCUMENTS = 40


def _corpus(path: Path) -> Path:
    words = "the a fox dog ran over under river stone light small large quick slow".split()
    g = torch.Generator().manual_seed(3)
    docs = []
    for i in range(DOCUMENTS):
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
    out, log = tmp_path / "store", tmp_path / "interrupted.log"
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

    log = tmp_path / "killed.log"  # each command's own log: a failure shows which one
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


def _group_alive(pgid: int) -> list[str]:
    """The processes of group `pgid` still running (zombies left out: they hold no memory), as
    "pid name"; waits up to 30 s for them to end."""
    deadline = time.monotonic() + 30
    while True:
        alive = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):  # ended while listed
                name, rest = stat.read_text().rsplit(")", 1)
                fields = rest.split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    alive.append(f"{stat.parent.name} {name.split('(', 1)[1]}")
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _handoffs() -> set[str]:
    """hookscope's handoff files in shared memory now (worker.py's HANDOFF_DIR)."""
    from hookscope.engines.vllm.worker import HANDOFF_DIR

    return {p.name for p in Path(HANDOFF_DIR).glob("hookscope-*")}


def _left_behind(before: set[str]) -> set[str]:
    """Handoff files made since `before` and still there a moment later (another session's capture
    may hold one for the moment between its worker's write and its caller's read)."""
    new = _handoffs() - before
    time.sleep(1)
    return new & _handoffs()


def _finish(run: subprocess.Popen, log: Path, what: str, stop=lambda: None, within: float = 90):
    """`stop()`, then the command's exit code `within` seconds, what of its process group still
    runs after it, and its log; the group killed whatever happens."""
    try:
        stop()
        try:
            code = run.wait(within)
        except subprocess.TimeoutExpired:
            pytest.fail(f"no exit within {within} s of {what}:\n{log.read_text()[-3000:]}")
        left = _group_alive(run.pid)
    finally:
        _kill_group(run)
    return code, left, log.read_text()


def _no_traceback(text: str) -> bool:
    """No traceback of the command's own: the engine core reports its view of a signal itself, each
    line prefixed by its name, then multiprocessing's "Process EngineCore:" and its traceback."""
    lines = text.splitlines()
    return not any(
        line.startswith("Traceback") and not (i and lines[i - 1].startswith("Process "))
        for i, line in enumerate(lines)
    )


# a default-layout command of its own and a resume: run with --full (the test command's time)
@pytest.mark.full
def test_ctrl_c_to_the_whole_group_exits_130_leaves_nothing_behind_and_resumes(case, reference, tmp_path):
    out, log = tmp_path / "store", tmp_path / "command.log"
    total, before = len(hs.open_store(reference)), _handoffs()
    run = _command(case, out, log)

    def ctrl_c():
        _wait_for_shards(run, out, 1, log)
        # a terminal's Ctrl-C: SIGINT to every process of the group, the engine's core and worker too
        os.killpg(run.pid, signal.SIGINT)

    code, left, text = _finish(run, log, "a group-wide SIGINT", ctrl_c)
    assert code == 130 and "hookscope: interrupted after" in text and _no_traceback(text), text[-3000:]
    assert not left, f"still running after the command exited: {left}"
    assert not _left_behind(before)
    interrupted = len(hs.open_store(out, verify=True))  # whole shards only
    assert SHARD_ROWS <= interrupted < total

    resumed = _command(case, out, log)  # the same command, to the end
    code, left, text = _finish(resumed, log, "the resumed run's start", within=600)
    assert code == 0 and _no_traceback(text), text[-3000:]
    assert not left, f"still running after the command exited: {left}"
    # the engine core had the time to remove its shared memory itself (liveness.shut_down)
    assert "leaked shared_memory" not in text, text[-3000:]
    assert not _left_behind(before)
    compared = compare_stores(out, reference)
    assert compared["rows"] == total and compared["rows_lost"] == compared["rows_duplicated"] == 0
    assert compared["same_values"] and compared["same_files"], compared


def _engine_core(run: subprocess.Popen, log: Path) -> int:
    """The pid of the command's engine core: its child that is neither the resource tracker nor
    another helper (vLLM names it EngineCore)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            name, rest = stat.read_text().rsplit(")", 1)
            if (
                int(rest.split()[1]) == run.pid
                and "EngineCore" in name + stat.with_name("cmdline").read_text()
            ):
                return int(stat.parent.name)
    pytest.fail(f"no EngineCore child of {run.pid}:\n{log.read_text()[-2000:]}")


# a default-layout command of its own and a resume: run with --full (the test command's time)
@pytest.mark.full
def test_a_dead_engine_core_ends_the_command_with_a_clear_error(case, tmp_path):
    out, log = tmp_path / "store", tmp_path / "command.log"
    run = _command(case, out, log)

    def kill_the_core():
        _wait_for_shards(run, out, 1, log)
        os.kill(_engine_core(run, log), signal.SIGKILL)  # as the out-of-memory killer would

    code, left, text = _finish(run, log, "the engine core's death", kill_the_core)
    lines = [line for line in text.splitlines() if line.startswith("hookscope: error:")]
    assert code == 2 and len(lines) == 1 and _no_traceback(text), text[-3000:]
    assert "vLLM engine died" in lines[0] and "exit code -9" in lines[0] and "resume" in lines[0]
    assert not left, f"still running after the command exited: {left}"
    hs.open_store(out, verify=True)  # what was written is whole


@pytest.mark.slow
def test_an_interrupt_between_the_handoff_and_its_copy_leaves_no_file(llm, monkeypatch):
    from hookscope.engines.vllm import worker

    written, before = [], _handoffs()

    def interrupted(handoff):
        written.append(handoff[0])
        assert os.path.exists(handoff[0])  # the worker wrote it; the caller never reads it
        raise KeyboardInterrupt

    monkeypatch.setattr(hv, "take_over", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hv.collect(llm, [[5, 6, 7, 8]], "blocks.0.resid_post")
    monkeypatch.setattr(hv, "take_over", worker.take_over)
    assert written and not os.path.exists(written[0])
    assert llm.collective_rpc("hookscope_hook_count") == [0]
    # the engine goes on: the next capture's rows come back, and its file is gone too
    (rows,) = hv.collect(llm, [[5, 6, 7, 8]], "blocks.0.resid_post")
    assert rows["blocks.0.resid_post"].shape == (4, 256)
    assert not _left_behind(before)


# -- refused before any work -------------------------------------------------------------------------


def test_a_point_vllm_never_exposes_is_refused_before_the_engine_starts(case, tmp_path):
    with pytest.raises(UnknownPointError, match="attn.pattern.*never materialise"):
        hs.extract(config(case, tmp_path / "s", engine="vllm", points=["blocks.0.attn.pattern"]))
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"engine_args": {"tensor_parallel_size": 2}}, "tensor_parallel_size=2.*not supported"),
        ({"engine_args": {"enforce_eager": False}}, "compiled graph.*compile_policy=hold_eager"),
        ({"engine_args": {"compile_policy": "full"}}, "not a compile policy of a vLLM engine"),
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
