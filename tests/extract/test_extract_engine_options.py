"""`--engine vllm` refusals that need no vLLM and no model: options that place or run the model in
this process, engine options without an engine, a malformed `--engine-arg`, an unknown engine, and
(where vLLM is not installed, as in the main environment) the extra to install. Each before anything
is loaded or written. The engine path itself: tests/engines/test_vllm_extract.py."""

from __future__ import annotations

import importlib.util

import pytest

from hookscope.cli import main
from hookscope.errors import EngineError, HookscopeError
from hookscope.extract import ExtractConfig, extract


@pytest.mark.parametrize(
    ("options", "flag"),
    [
        ({"max_memory": "1GiB"}, "--max-memory"),
        ({"device_map": "auto"}, "--device-map"),
        ({"generate": 4}, "--generate"),
        ({"device": "cuda"}, "--device"),
        ({"tp": 2}, "--tp"),
    ],
)
def test_options_that_place_the_model_here_are_refused(tmp_path, options, flag):
    with pytest.raises(HookscopeError, match=f"{flag} .*the engine places and runs the model itself"):
        extract(ExtractConfig(out=str(tmp_path / "s"), model=str(tmp_path), engine="vllm", **options))
    assert not (tmp_path / "s").exists()


def test_engine_options_need_an_engine_and_a_known_one(tmp_path):
    with pytest.raises(HookscopeError, match="--engine-arg sets an engine's options: add --engine vllm"):
        extract(ExtractConfig(out=str(tmp_path / "s"), engine_args={"max_num_seqs": 4}))
    with pytest.raises(HookscopeError, match="the one engine is vllm"):
        extract(ExtractConfig(out=str(tmp_path / "s"), model=str(tmp_path), engine="sglang"))
    with pytest.raises(HookscopeError, match="give MODEL"):
        extract(ExtractConfig(out=str(tmp_path / "s"), engine="vllm"))
    assert not (tmp_path / "s").exists()


def test_engine_arg_is_key_equals_value(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["extract", "--out", str(tmp_path / "s"), "--engine", "vllm", "--engine-arg", "max_num_seqs"])
    assert stop.value.code == 2
    assert "write KEY=VALUE" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_the_error_names_the_extra(tmp_path):
    with pytest.raises(EngineError, match=r"pip install 'hookscope\[vllm\]'"):
        extract(ExtractConfig(out=str(tmp_path / "s"), model=str(tmp_path), engine="vllm"))
    assert not (tmp_path / "s").exists()
