"""Rows per request: requests of different lengths (5 to 200 tokens) submitted together, with chunked
prefill splitting the long ones across forwards shared with the others, each get rows equal to that
request run alone (and to Hugging Face's); what the served verbs refuse, before any work. (A
capture under prefix caching: test_vllm_names.py, on every family.)
"""

from __future__ import annotations

import types

import pytest
import torch
from gate import need

vllm = need("vllm")

from vllm_models import assert_close, hf_model  # noqa: E402

import hookscope as hs  # noqa: E402
from hookscope.engines import vllm as hv  # noqa: E402

LENGTHS = (5, 17, 33, 64, 90, 128, 150, 200)
POINTS = [
    "blocks.*.resid_post",
    "blocks.1.resid_mid",
    "blocks.0.attn.z",
    "blocks.1.attn.k",
    "blocks.1.mlp.post",
]


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(1, 250, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def llama(default_layout_llama):
    """The llama test_vllm_selections.py shares (vllm_shared.start_default_layout_llama): 64 tokens
    per forward, so the 200-token prompt takes 4 forwards, each shared with other requests' chunks."""
    return default_layout_llama.directory, default_layout_llama.llm


def test_requests_together_equal_each_alone(llama):
    directory, llm = llama
    together = hs.collect(llm, prompts(), POINTS)
    hf = hf_model(directory)
    for prompt, rows in zip(prompts(), together, strict=True):
        (alone,) = hs.collect(llm, [prompt], POINTS)
        assert set(rows) == set(alone) and len(rows) == 6
        for name in rows:
            assert rows[name].shape[0] == len(prompt), name
            assert_close(rows[name], alone[name], f"{name}, {len(prompt)} tokens, batched vs alone")
        want = hs.collect(hf, torch.tensor([prompt]), "blocks.1.resid_post")["blocks.1.resid_post"][0]
        assert_close(rows["blocks.1.resid_post"], want, f"{len(prompt)} tokens vs Hugging Face")


def test_strings_are_tokenized_by_the_engine(llama):
    _, llm = llama
    text = "Paris is the capital of France"
    (rows,) = hs.collect(llm, text, "blocks.0.resid_post")
    ids = llm.get_tokenizer()(text)["input_ids"]
    (by_ids,) = hs.collect(llm, [ids], "blocks.0.resid_post")
    (by_tensor,) = hs.collect(llm, torch.tensor(ids), "blocks.0.resid_post")  # a 1-D tensor: one prompt
    assert torch.equal(rows["blocks.0.resid_post"], by_ids["blocks.0.resid_post"])
    assert torch.equal(by_tensor["blocks.0.resid_post"], by_ids["blocks.0.resid_post"])


def test_hooks_are_gone_after_a_capture(llama):
    _, llm = llama
    hs.collect(llm, prompts()[:2], POINTS)
    counts = llm.collective_rpc("hookscope_hook_count")
    assert counts == [0]


def test_options_the_engine_cannot_take_are_refused(llama):
    _, llm = llama
    with pytest.raises(hs.EngineError, match="takes no arch yet"):
        hs.collect(llm, prompts()[:1], "blocks.0.resid_post", arch=hv.check_engine(llm)[1])
    with pytest.raises(hs.EngineError, match="takes no gather yet"):
        hs.collect(llm, prompts()[:1], "blocks.0.attn.z", gather=False)


def fake_llm(**settings):
    """An object shaped like vllm.LLM for the checks that read only its config."""
    config = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(
            worker_extension_cls=settings.get("extension", hv.EXTENSION),
            tensor_parallel_size=1,
            pipeline_parallel_size=settings.get("pp", 1),
        ),
        model_config=types.SimpleNamespace(enforce_eager=settings.get("eager", True), hf_config=None),
        additional_config={},
    )
    cls = type("LLM", (), {"__module__": "vllm.entrypoints.llm"})
    llm = cls()
    llm.llm_engine = types.SimpleNamespace(vllm_config=config)
    return llm


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"extension": ""}, "worker_extension_cls="),
        ({"eager": False}, "enforce_eager=True"),
        ({"pp": 2}, "pipeline_parallel_size=1"),
    ],
)
def test_engine_settings_hookscope_cannot_read_are_refused(settings, match):
    with pytest.raises(hs.EngineError, match=match):
        hv.check_engine(fake_llm(**settings))


def test_another_engine_or_vllm_release_is_refused(monkeypatch):
    with pytest.raises(hs.EngineError, match="not a vLLM engine"):
        hv.check_engine(object())
    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    with pytest.raises(hs.EngineError, match="vLLM 0.31.2 is not a version"):
        hv.check_engine(fake_llm())
