"""The `hookscope` command's points / capture / profile: what they print and save is what the
library computes."""

import json

import torch
from safetensors.torch import load_file

import hookscope as hs
from hookscope.cli import main


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
    assert main(["capture", str(tiny_dirs["llama"]), "--point", "blocks.1.resid_post,blocks.0.attn.q",
                 "--text", text, "--positions", "last", "--save", str(path)]) == 0
    loaded = hs.load(str(tiny_dirs["llama"]))
    ids = dict(loaded.tokenizer([text], return_tensors="pt"))
    want = hs.collect(loaded.model, ids, ["blocks.1.resid_post", "blocks.0.attn.q"], positions="last")
    got = load_file(str(path))
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name])
    assert "blocks.0.attn.q: shape [1, 4, 16]" in capsys.readouterr().out


def test_unknown_point_is_a_clear_error(tiny_dirs, capsys):
    assert main(["capture", str(tiny_dirs["gpt2"]), "--point", "blocks.1.resid_pots"]) == 2
    err = capsys.readouterr().err
    assert "unknown point" in err and "blocks.1.resid_post" in err


def test_profile_writes_its_files(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "prof"
    assert main(["profile", str(tiny_dirs["gpt2"]), "--batch", "2", "--seq", "8", "--steps", "1",
                 "--warmup", "0", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for block in ("blocks.0", "blocks.1", "blocks.2"):
        assert block in text
    trace = json.loads((out / "trace.json").read_text())
    assert any("blocks.2" in str(e.get("name", "")) for e in trace["traceEvents"])
    assert (out / "time_per_block.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
