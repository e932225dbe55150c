"""The `hookscope` command's points / capture / profile: what they print and save is what the
library computes."""

import importlib.util
import json
import os
import re
import stat
import sys

import pytest
import torch
from safetensors.torch import load_file

import hookscope as hs
from hookscope.cli import main
from hookscope.store import ShardWriter


def test_points_lists_every_point_with_shapes(tiny_dirs, capsys):
    assert main(["points", str(tiny_dirs["gpt2"])]) == 0
    out = capsys.readouterr().out
    arch = hs.load(str(tiny_dirs["gpt2"])).arch
    for name in arch.names:
        assert f"  {name} " in out
    assert "[1, " in out  # shapes measured on the sample sentence


def test_capture_saves_what_collect_returns(tiny_dirs, tmp_path, capsys):
    path = tmp_path / "acts.safetensors"
    text = "the quick brown fox"
    assert (
        main(
            [
                "capture",
                str(tiny_dirs["llama"]),
                "--point",
                "blocks.1.resid_post,blocks.0.attn.q",
                "--text",
                text,
                "--positions",
                "last",
                "--save",
                str(path),
            ]
        )
        == 0
    )
    loaded = hs.load(str(tiny_dirs["llama"]))
    ids = dict(loaded.tokenizer([text], return_tensors="pt"))
    want = hs.collect(loaded.model, ids, ["blocks.1.resid_post", "blocks.0.attn.q"], positions="last")
    got = load_file(str(path))
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name])
    assert "blocks.0.attn.q: shape [1, 4, 16]" in capsys.readouterr().out


def test_capture_reads_only_the_weights_its_points_need(tiny_dirs, monkeypatch, capsys):
    loaded_models = []
    real_load = hs.load

    def spying_load(*args, **kwargs):
        loaded_models.append(real_load(*args, **kwargs))
        return loaded_models[-1]

    monkeypatch.setattr(hs, "load", spying_load)
    assert main(["capture", str(tiny_dirs["llama"]), "--points", "blocks.0.resid_post"]) == 0
    (model,) = [loaded.model for loaded in loaded_models]
    on_meta = {name.split(".")[2] for name, p in model.named_parameters() if p.is_meta and ".layers." in name}
    assert on_meta == {"1", "2"} and model.model.norm.weight.is_meta  # blocks 1-2 and the norm never read
    assert "blocks.0.resid_post: shape [1, " in capsys.readouterr().out


def test_unknown_point_is_a_clear_error(tiny_dirs, capsys):
    assert main(["capture", str(tiny_dirs["gpt2"]), "--point", "blocks.1.resid_pots"]) == 2
    err = capsys.readouterr().err
    assert "unknown point" in err and "blocks.1.resid_post" in err


def test_profile_writes_its_files(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "prof"
    assert (
        main(
            [
                "profile",
                str(tiny_dirs["gpt2"]),
                "--batch",
                "2",
                "--seq",
                "8",
                "--steps",
                "1",
                "--warmup",
                "0",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    for block in ("blocks.0", "blocks.1", "blocks.2"):
        assert block in text
    trace = json.loads((out / "trace.json").read_text())
    assert any("blocks.2" in str(e.get("name", "")) for e in trace["traceEvents"])
    assert (out / "time_per_block.svg").read_text().lstrip().startswith("<svg")  # the base install's picture
    if importlib.util.find_spec("matplotlib") is None:  # the base test environment: no PNG, no error
        assert not (out / "time_per_block.png").exists()
    else:
        assert (out / "time_per_block.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_with_points_runs_as_far_as_their_weights(tiny_dirs, capsys):
    assert (
        main(
            [
                "profile",
                str(tiny_dirs["llama"]),
                "--points",
                "blocks.1.resid_post",
                "--batch",
                "1",
                "--seq",
                "8",
                "--steps",
                "1",
                "--warmup",
                "0",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "not profiled: block 2 of 3 and what follows" in text
    rows = [line.split()[0] for line in text.splitlines() if line.startswith("blocks.")]
    assert rows == ["blocks.0", "blocks.1"]  # the table's rows: block 2 never ran


def test_profile_refuses_a_sequence_longer_than_the_model_before_profiling(tiny_dirs, tmp_path, capsys):
    longest = json.loads((tiny_dirs["gpt2"] / "config.json").read_text())["n_positions"]
    out = tmp_path / "prof"
    assert main(["profile", str(tiny_dirs["gpt2"]), "--seq", str(longest + 1), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert (
        f"--seq {longest + 1} is longer than the model's {longest} positions; use --seq {longest} or less"
    ) in err
    assert not any(out.iterdir())  # made writable up front, but nothing profiled into it


# -- papercuts ------------------------------------------------------------------------------------


def test_points_and_point_are_both_accepted(tiny_dirs, tmp_path, capsys):
    model = str(tiny_dirs["gpt2"])
    for flag in ("--points", "--point"):
        assert main(["capture", model, flag, "blocks.0.resid_post,blocks.1.mlp.post"]) == 0
        out = capsys.readouterr().out
        assert "blocks.0.resid_post: shape [1, " in out and "blocks.1.mlp.post: shape [1, " in out
        assert (
            main(
                [
                    "extract",
                    model,
                    flag,
                    "blocks.0.resid_post",
                    "--out",
                    str(tmp_path / flag),
                    "--data",
                    "builtin:stdlib-docstrings",
                    "--context",
                    "16",
                    "--max-tokens",
                    "64",
                    "--no-progress",
                ]
            )
            == 0
        )
        assert list(hs.open_store(tmp_path / flag).points) == ["blocks.0.resid_post"]
    capsys.readouterr()
    help_text = hs_cli_help("capture")
    assert "--points" in help_text and "--point " not in help_text  # one spelling documented


def hs_cli_help(command: str) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([command, "--help"])
    return out.getvalue()


def test_bad_positions_say_what_is_accepted(tiny_dirs, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["capture", str(tiny_dirs["gpt2"]), "--points", "blocks.0.resid_post", "--positions", "abc"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "'abc' is not a position selection: use all, last, N, A:B or i,j,k" in err
    assert "_positions" not in err


def test_capture_save_follows_the_umask(tiny_dirs, tmp_path):
    path = tmp_path / "acts.safetensors"
    old = os.umask(0o022)
    try:
        assert (
            main(["capture", str(tiny_dirs["gpt2"]), "--point", "blocks.0.resid_post", "--save", str(path)])
            == 0
        )
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert set(load_file(str(path))) == {"blocks.0.resid_post"}


def test_a_closed_pipe_ends_quietly(tiny_dirs, tmp_path, monkeypatch, capsys):
    """`hookscope inspect DIR | head`: the reader goes away; no BrokenPipeError traceback."""
    out = tmp_path / "store"
    assert (
        main(
            [
                "extract",
                str(tiny_dirs["gpt2"]),
                "--out",
                str(out),
                "--context",
                "16",
                "--points",
                "blocks.0.resid_post",
                "--max-tokens",
                "64",
                "--no-progress",
            ]
        )
        == 0
    )
    capsys.readouterr()
    read, write = os.pipe()
    os.close(read)  # the reader has left before we print anything
    closed = open(write, "w", buffering=1)
    monkeypatch.setattr(sys, "stdout", closed)
    assert main(["inspect", str(out)]) == 0  # and no exception
    monkeypatch.undo()
    closed.close()


def test_inspect_on_an_empty_store_says_so(tmp_path, capsys):
    with ShardWriter(tmp_path / "empty", {"k": 1}):
        pass
    assert main(["inspect", str(tmp_path / "empty")]) == 2
    captured = capsys.readouterr()
    assert "holds 0 rows" in captured.err and "verified" not in captured.out


def test_points_shows_its_sentence_and_a_token_count_unlike_the_head_count(minilm, capsys):
    assert main(["points"]) == 0
    out = capsys.readouterr().out
    match = re.search(r"shapes on '(.+)' \((\d+) tokens", out)
    assert match, out[:500]
    text, count = match.group(1), int(match.group(2))
    assert count == len(minilm.tokenizer(text)["input_ids"]) and count != minilm.arch.n_heads
    assert "blocks.0.attn.z  " in out and f"[1, {count}, 12, 32]" in out


def test_extract_progress_counts_rows_against_an_estimated_total(tiny_dirs, tmp_path, monkeypatch):
    import tqdm.auto

    from hookscope.extract import ExtractConfig, extract

    frames = []

    class Recorder:  # stands in for tqdm: what the bar would show at each update
        def __init__(self, **kwargs):
            self.kwargs, self.n, self.total, self.postfix = kwargs, 0, None, ""

        def update(self, n):
            self.n += n
            frames.append((self.n, self.total, self.postfix))

        def set_postfix_str(self, text, refresh=True):
            self.postfix = text

        def refresh(self):
            frames.append((self.n, self.total, self.postfix))

        def close(self):
            frames.append(("closed", self.n, self.total))

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorder)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"Paragraph {i}: some words about a fox and a dog.\n\n" for i in range(300)))
    summary = extract(
        ExtractConfig(
            out=str(tmp_path / "s"),
            model=str(tiny_dirs["gpt2"]),
            points=["blocks.0.resid_post"],
            data=str(corpus),
            context=16,
            batch_size=4,
            shard_rows=100,
        )
    )
    assert frames[-1] == ("closed", summary.rows, summary.rows)  # rows, the summary's unit, 100% at the end
    first_n, first_total, _ = frames[0]
    assert first_total is not None and 0.5 * summary.rows < first_total < 2 * summary.rows  # estimated early
    # not lagging the files; then the rate, each stage's busy share and the bound (extract/stages.py)
    assert frames[-2][2].startswith(f"{summary.bytes_written / 2**20:,.1f} MiB written, ")
    assert "busy: data " in frames[-2][2]
    assert "; bound by the " in frames[-2][2] or "; no stage saturated: " in frames[-2][2]


def test_no_empty_bar_before_an_early_error(tiny_dirs, tmp_path, capsys):
    tiny_corpus = tmp_path / "short.txt"
    tiny_corpus.write_text("too short\n")
    assert (
        main(
            [
                "extract",
                str(tiny_dirs["gpt2"]),
                "--out",
                str(tmp_path / "s"),
                "--data",
                str(tiny_corpus),
                "--points",
                "blocks.0.resid_post",
                "--context",
                "32",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "not enough for one sequence" in err  # an error found only once the data is read
    assert err.startswith("hookscope: error: ") and "extract" not in err.split("error: ", 1)[0]
    assert "tok" not in err.replace("tokens", "") and "row/s" not in err and "it/s" not in err


def test_extract_flags_left_out_run_the_config_defaults(tmp_path, monkeypatch):
    """`hookscope extract --out S` with nothing else runs exactly `ExtractConfig(out=S)` (with the
    progress bar): a flag whose default drifted from the config's (batch size 8, float16, 65,536
    rows per shard, ...) is caught here."""
    import dataclasses
    import importlib

    extract_room = importlib.import_module("hookscope.extract")
    ran = []
    monkeypatch.setattr(extract_room, "extract", lambda cfg: ran.append(cfg) or "ok")
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    out = str(tmp_path / "s")
    assert main(["extract", "--out", out]) == 0
    expected = dataclasses.asdict(extract_room.ExtractConfig(out=out))
    assert dataclasses.asdict(ran[0]) == expected
    assert (expected["batch_size"], expected["dtype"], expected["shard_rows"]) == (8, "float16", 65536)
