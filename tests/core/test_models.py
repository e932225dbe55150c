"""Loading: the bundled real all-MiniLM-L6-v2 offline, tiny models by path with the weights they
were saved with, and clear errors for paths that are not models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import count_connections

import hookscope as hs
from hookscope.loading import DEFAULT_MODEL
from hookscope.testing import build_tiny

CLASSES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "bert": "BertModel",
}


def embed(loaded: hs.Loaded, sentences: list[str]) -> torch.Tensor:
    """Sentence embeddings as sentence-transformers makes them: mean over real tokens, unit length."""
    enc = loaded.tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = loaded.model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def test_bundled_default_is_minilm(minilm):
    model, tok, arch = minilm
    assert type(model).__name__ == "BertModel" and not model.training
    assert minilm.name == DEFAULT_MODEL and arch.family == "bert"
    assert (arch.n_layers, arch.n_heads, arch.d_model) == (6, 12, 384)
    assert tok("hello world")["input_ids"][0] == tok.cls_token_id


def test_minilm_embeddings_are_sane_and_deterministic(minilm):
    sentences = [
        "A man is playing a guitar.",
        "Someone plays the guitar.",
        "The stock market fell sharply today.",
    ]
    e = embed(minilm, sentences)
    assert torch.equal(e, embed(minilm, sentences))
    assert torch.allclose(e.norm(dim=-1), torch.ones(3))
    paraphrase, unrelated = float(e[0] @ e[1]), float(e[0] @ e[2])
    assert paraphrase > 0.6 and unrelated < 0.3 and paraphrase > unrelated + 0.3


@pytest.mark.parametrize("key", ["gpt2", "llama", "neox_parallel", "bert"])
def test_tiny_model_loads_by_path_with_its_weights(tiny, key):
    loaded = tiny[key]
    family = {"neox_parallel": "gpt_neox"}.get(key, key)
    assert loaded.arch.family == family
    assert type(loaded.model).__name__ == CLASSES[family]  # the LM head when the family has one
    rebuilt = build_tiny(
        family, vocab_size=loaded.model.config.vocab_size, d_model=64, n_layers=3, n_heads=4, context=64
    )
    saved = loaded.model.state_dict()
    for name, value in rebuilt.state_dict().items():
        assert torch.equal(saved[name], value), name
    assert len(loaded.tokenizer("The quick brown fox")["input_ids"]) > 0


def test_tiny_dirs_hold_safetensors_only(tiny_dirs):
    for path in tiny_dirs.values():
        assert (
            list(path.glob("*.safetensors")) and not list(path.glob("*.bin")) and not list(path.glob("*.pt"))
        )


def test_missing_paths_raise_model_load_error(tmp_path):
    with pytest.raises(hs.ModelLoadError, match="no model directory"):
        hs.load("/nonexistent")
    (tmp_path / "weights.txt").write_text("not a model")
    with pytest.raises(hs.ModelLoadError, match="no config.json"):
        hs.load(str(tmp_path))
    assert issubclass(hs.ModelLoadError, hs.HookscopeError)


def test_an_unreachable_hub_fails_fast_naming_the_offline_options(monkeypatch, tmp_path):
    """A hub id the cache does not hold, on a machine that cannot reach the hub: a clear error after
    one connection attempt, not ~20 s of retries (the attempts are counted: no clock)."""
    from hookscope.hub import OFFLINE_VARIABLES

    for variable in OFFLINE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    connections = count_connections(monkeypatch)
    with pytest.raises(hs.ModelLoadError) as caught:
        hs.load("gpt2-not-cached-here")
    assert connections == [("127.0.0.1", 9)]  # one probe, no retries
    message = str(caught.value)
    assert "not a local directory and not in the Hugging Face cache" in message
    assert "cannot connect to 127.0.0.1:9" in message and "HF_HUB_OFFLINE=1" in message and "./" in message
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    connections.clear()
    with pytest.raises(hs.ModelLoadError, match="HF_HUB_OFFLINE=1 is set"):
        hs.load("gpt2-not-cached-here")
    assert connections == []


def test_load_draws_no_progress_bar(tiny_dirs):
    from transformers.utils import logging

    made = []

    def record(factory, args, kwargs):
        made.append((factory.__name__, kwargs.get("desc")))
        return factory(*args, **kwargs)

    was_enabled = logging.is_progress_bar_enabled()  # the CLI tests turn bars off for the process
    logging.enable_progress_bar()  # a user who has bars on
    logging.set_tqdm_hook(record)
    try:
        hs.load(str(tiny_dirs["gpt2"]))
        assert logging.is_progress_bar_enabled()  # the user's setting is back as it was
    finally:
        logging.set_tqdm_hook(None)
        if not was_enabled:
            logging.disable_progress_bar()
    assert made and all(name == "EmptyTqdm" for name, _ in made), made  # every bar asked for was a no-op
