"""Rejected and interrupted runs (issue 14, items 3 and 4), for every source (tests/kit/source_kit.py:
packed text, text + generated continuation, images).

A run refused for a bad argument, an empty or missing data source or an unloadable model leaves no
trace on disk, so the corrected command then runs into the same --out. A real SIGINT / SIGTERM at
several moments of an extraction stops it with exit code 130 and one line; the store keeps only
whole shards that an uninterrupted run also cuts, and the same command then finishes a store that
equals the uninterrupted one byte for byte (every shard and manifest.json).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from fault_log import record
from forkserver import ForkServer
from source_kit import SOURCES, Case, PerSource, make_case

from hookscope.cli import main
from hookscope.store import open_store

RUN_CLI = "kill_driver:run_cli"
MAX_TOKENS = "300"
OPTIONS = {"points": ["blocks.1.resid_post", "blocks.0.mlp.post"], "dtype": "float16", "shard_rows": 150}


@pytest.fixture(scope="module")
def cases(tiny_dirs, tmp_path_factory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("sources")
    return {
        source: make_case(source, tiny_dirs, root / source, docs=40, images=60, **OPTIONS)
        for source in SOURCES
    }


def tree(path: Path) -> dict[str, str]:
    """Every file under `path` with its SHA-256: what a run left on disk."""
    if not path.exists():
        return {}
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def references(cases, tmp_path_factory) -> dict[str, Path]:
    """Each source's uninterrupted store, made when a test first asks for it."""

    def make(source: str) -> Path:
        out = tmp_path_factory.mktemp(f"reference-{source}") / "store"
        assert main(cases[source].cli(out)) == 0
        return out

    return PerSource(make)


# -- rejected runs ------------------------------------------------------------------------------

ALL = set(SOURCES)
TEXT = {"text", "generated"}
# what is wrong -> (the sources it applies to, the flags that make it wrong)
REJECTED = {
    "--batch-size 0": (ALL, lambda case, d: {"--batch-size": "0"}),
    "--context 0": (TEXT, lambda case, d: {"--context": "0"}),
    "--max-tokens 0": (ALL, lambda case, d: {"--max-tokens": "0"}),
    "an empty data source": (ALL, lambda case, d: {"--data": case.empty_data(d)}),
    "a data file of blank lines": (TEXT, lambda case, d: {"--data": str(_write(d / "blank.txt", "\n \n\n"))}),
    "a data source that does not exist": (ALL, lambda case, d: {"--data": case.missing_data(d)}),
    "a data file of an unsupported type": (
        TEXT,
        lambda case, d: {"--data": str(_write(d / "data.csv", "a,b\n"))},
    ),
    "a point the model does not have": (ALL, lambda case, d: {"--points": "blocks.9.resid_post"}),
    "--context for images": ({"images"}, lambda case, d: {"--context": "16"}),
    "--generate for images": ({"images"}, lambda case, d: {"--generate": "2"}),
    "--max-tokens below one image": ({"images"}, lambda case, d: {"--max-tokens": "5"}),
}


def _of(source: str) -> str:
    """How a fault record names the source (text keeps the names its records had)."""
    return "" if source == "text" else f" ({source})"


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _rejected(source: str) -> list[str]:
    return [bad for bad, (sources, _) in REJECTED.items() if source in sources]


def _rejected_run(case: Case, out: Path, folder: Path, bad: str, capsys) -> tuple[int, str, bool]:
    """`bad`'s command into `out`: its exit code, its stderr, and whether it left anything there
    (removed, so that the next command starts where no store is)."""
    wrong = REJECTED[bad][1](case, folder) if bad in REJECTED else {}
    args = case.cli(out, **{"--max-tokens": MAX_TOKENS, **wrong})
    if bad == "a model that cannot be loaded":
        args[1] = str(folder / "no-such-model")
    code = main(args)
    left = out.exists()  # no directory, no manifest, no shard
    shutil.rmtree(out, ignore_errors=True)
    return code, capsys.readouterr().err, left


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.slow
def test_rejected_runs_leave_no_trace_and_an_existing_store_untouched(cases, tmp_path, capsys, source):
    """Every bad command where no store is leaves nothing, so the corrected command then runs into
    the same --out; every bad command into that store then leaves it as it was. Before: a 0-row
    manifest.json locked in the bad settings and the corrected command was refused (`batch_size:
    stored 0, given 8`)."""
    case, out = cases[source], tmp_path / "store"
    refused = {
        bad: _rejected_run(case, out, tmp_path, bad, capsys)
        for bad in [*_rejected(source), "a model that cannot be loaded"]
    }
    again = main(case.cli(out, **{"--max-tokens": MAX_TOKENS}))  # the corrected command
    capsys.readouterr()
    rows = len(open_store(out, verify=True)) if again == 0 else 0
    for bad, (code, _, left) in refused.items():
        survived = code == 2 and not left and again == 0 and rows > 0
        record("rejected", f"new store{_of(source)}: {bad}", survived=int(survived))
    for bad, (code, err, left) in refused.items():
        assert code == 2 and err.startswith("hookscope: error: ") and "Traceback" not in err, (bad, err)
        assert not left, bad
    assert again == 0 and rows > 0  # the corrected command, into the same --out

    before = tree(out)
    for bad in _rejected(source):
        wrong_args = {"--max-tokens": MAX_TOKENS, **REJECTED[bad][1](case, tmp_path)}
        code = main(case.cli(out, **wrong_args))
        untouched = tree(out) == before
        record("rejected", f"existing store{_of(source)}: {bad}", survived=int(code == 2 and untouched))
        assert code == 2 and untouched, bad
    capsys.readouterr()


# -- interrupts ---------------------------------------------------------------------------------

# (signal, where it lands: see tests/kit/kill_driver.py): os.replace 1 is the manifest stamp at open,
# then per shard its rename and the manifest replace; forward counts module calls, tokenize
# tokenizer calls, batch the batches handed to the writer; save and fsync run in the writer thread
SIGNALS = [
    ("INT", "tokenize:1", "while the first batch is tokenized (nothing written yet)"),
    ("INT", "replace:1:after", "right after the store is stamped (no shard yet)"),
    ("INT", "forward:40", "in the middle of a forward pass"),
    ("INT", "batch:3", "as a batch is queued (the writer thread mid-shard)"),
    ("INT", "save:2", "while the writer thread saves a shard"),
    ("INT", "rename:3:after", "right after a shard's rename, before its manifest"),
    ("INT", "fsync:6", "inside an fsync (writer thread)"),
    ("INT", "batch:14", "late in the run"),
    ("TERM", "batch:5", "as a batch is queued"),
    ("TERM", "forward:300", "in the middle of a forward pass"),
]


# the sites every source runs by default; the rest run with --full for the sources besides text
EVERY_SOURCE = {"batch:3"}  # mid-shard; TERM and the other sites: text; all with --full


def _interrupts() -> list:
    params = []
    for source in SOURCES:
        for sig, at, what in SIGNALS:
            if at.startswith("tokenize") and source == "images":
                continue  # no tokenizer
            slow = source != "text" and at not in EVERY_SOURCE
            params.append(
                pytest.param(
                    source,
                    sig,
                    at,
                    what,
                    id=f"{source}-{sig}-{at}",
                    marks=(pytest.mark.full,) if slow else (),
                )
            )
    return params


@pytest.fixture(scope="module")
def server(tiny_dirs) -> ForkServer:
    """Each interrupted run is a child of the fork server the kill sweep uses: a real, separate
    process that a signal stops, without a Python start-up each."""
    server = ForkServer.shared()
    server.warm("faultkit:load_model", path=str(tiny_dirs["gpt2"]))
    return server


@pytest.mark.parametrize(("source", "sig", "at", "what"), _interrupts())
@pytest.mark.slow
def test_interrupt_then_resume_equals_uninterrupted(
    cases, references, server, tmp_path, source, sig, at, what
):
    """Before: ~40 lines of KeyboardInterrupt traceback, and the resumed store had 5 shards instead
    of 4 (the interrupted run flushed a partial shard); image extraction died by the signal with a
    traceback (exit -2)."""
    reference = references[source]
    out = tmp_path / "store"
    args = cases[source].cli(out)
    run = server.call(RUN_CLI, args=args, signal_name=sig, kill_at=at, timeout=600)
    code, stderr = (run.result["code"], run.result["stderr"]) if run.status == 0 else (None, run.log)
    ref = open_store(reference)
    stopped = open_store(out).manifest.shards if (out / "manifest.json").exists() else []
    committed = [(s.file, s.checksum) for s in stopped]
    rows = sum(s.rows for s in stopped)
    last_line = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    clean = (
        code == 130
        and "Traceback" not in stderr + run.log
        and last_line == f"hookscope: interrupted after {rows:,} rows; run the same command to resume"
    )
    whole_shards = committed == [(s.file, s.checksum) for s in ref.manifest.shards[: len(committed)]]
    no_debris = set(tree(out / "shards")) == {Path(f).name for f, _ in committed}
    again = main(args)  # the same command
    same = again == 0 and tree(out) == tree(reference)
    record(
        "interrupt",
        f"SIG{sig} {what}{_of(source)}",
        survived=int(clean and whole_shards and no_debris and same),
        rows_checked=len(ref),
        rows_lost=max(len(ref) - len(open_store(out)), 0) if again == 0 else None,
        rows_duplicated=max(len(open_store(out)) - len(ref), 0) if again == 0 else None,
    )
    assert code == 130, (run.status, run.log[-3000:])
    assert clean, stderr[-3000:] + run.log[-3000:]
    assert whole_shards  # only shards an uninterrupted run also cuts
    assert len(committed) < ref.num_shards  # it really stopped before the end
    assert no_debris  # no partial shard, no .tmp file
    assert again == 0 and tree(out) == tree(reference)  # byte for byte: every shard and manifest.json
