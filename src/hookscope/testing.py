"""Tiny random-init models for tests, examples and benchmarks, built offline.

Each is a real Hugging Face model built from a config, saved with `save_pretrained` together
with a tokenizer trained on the spot by the `tokenizers` library, so it loads by path through
exactly the code a hub model takes (`hs.load(path)`).
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("gpt2", "llama", "gpt_neox", "bert")

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Interpretability researchers read the residual stream one layer at a time.",
    "A sparse autoencoder learns a dictionary of features from activations.",
    "Hooks attach to modules; they should cost nothing when they do nothing.",
    "Paris is the capital of France, and Rome is the capital of Italy.",
    "def add(a, b):\n    return a + b",
] * 4


def train_tokenizer(vocab_size: int = 512, *, bert: bool = False, corpus: list[str] | None = None):
    """A small BPE (GPT-style) or WordPiece (BERT-style) fast tokenizer, trained in well under a second."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = corpus or _CORPUS
    if bert:
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.train_from_iterator(
            corpus, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials))
        cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
        )
        tok.decoder = decoders.WordPiece()
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
            sep_token="[SEP]", mask_token="[MASK]",
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>",
    )


def tiny_config(family: str, *, vocab_size: int = 512, d_model: int = 64, n_layers: int = 3,
                n_heads: int = 4, context: int = 128, **overrides):
    """The config of a small random model of one family."""
    from transformers import BertConfig, GPT2Config, GPTNeoXConfig, LlamaConfig

    d_mlp = 4 * d_model
    if family == "gpt2":
        cfg = GPT2Config(vocab_size=vocab_size, n_embd=d_model, n_layer=n_layers, n_head=n_heads,
                         n_positions=context, bos_token_id=0, eos_token_id=0)
    elif family == "llama":
        cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=d_mlp,
                          num_hidden_layers=n_layers, num_attention_heads=n_heads,
                          num_key_value_heads=max(1, n_heads // 2), max_position_embeddings=context,
                          bos_token_id=0, eos_token_id=0, pad_token_id=None)
    elif family == "gpt_neox":
        cfg = GPTNeoXConfig(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=d_mlp,
                            num_hidden_layers=n_layers, num_attention_heads=n_heads, rotary_pct=0.25,
                            max_position_embeddings=context, use_parallel_residual=True,
                            bos_token_id=0, eos_token_id=0)
    elif family == "bert":
        cfg = BertConfig(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=d_mlp,
                         num_hidden_layers=n_layers, num_attention_heads=n_heads,
                         max_position_embeddings=context, pad_token_id=0)
    else:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def build_tiny(family: str, *, seed: int = 0, **config_kwargs):
    """A random-init model (causal LM head except BERT) in eval mode."""
    from transformers import AutoModel, AutoModelForCausalLM

    cfg = tiny_config(family, **config_kwargs)
    torch.manual_seed(seed)
    auto = AutoModel if family == "bert" else AutoModelForCausalLM
    return auto.from_config(cfg).eval()


def save_tiny(family: str, directory: str | Path, *, seed: int = 0, **config_kwargs) -> Path:
    """Build a tiny model + tokenizer and save both with save_pretrained; returns the directory."""
    directory = Path(directory)
    tok = train_tokenizer(config_kwargs.get("vocab_size", 512), bert=family == "bert")
    model = build_tiny(family, seed=seed, vocab_size=len(tok),
                       **{k: v for k, v in config_kwargs.items() if k != "vocab_size"})
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def gpt2_small_config(**overrides):
    """GPT-2-small's shape (12 layers, d_model 768, 12 heads, 50257 tokens), for benchmarks."""
    from transformers import GPT2Config

    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg
