"""Tiny random-init models for tests, examples and benchmarks, built offline.

Each is a real Hugging Face model built from a config, saved with `save_pretrained` together
with a tokenizer trained on the spot by the `tokenizers` library, so it loads by path through
exactly the code a hub model takes (`hs.load(path)`).
"""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("gpt2", "llama", "gpt_neox", "bert")
# mixture-of-experts decoders (arch/moe.py): 4 experts, top-2, tiny expert MLPs
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# image encoders (arch/vit.py, clip.py, dinov2.py): 32x32 pixels in 8x8 patches (a 4x4 grid);
# saved with their image processor (the Pillow backend: no torchvision)
VISION_FAMILIES = ("vit", "clip_vision_model", "siglip_vision_model", "dinov2", "dinov2_with_registers")
# state-space / recurrent language models (arch/mamba.py, rwkv.py)
SSM_FAMILIES = ("mamba", "rwkv")
_IMAGE_PROCESSORS = {
    "vit": "ViTImageProcessorPil",
    "clip_vision_model": "CLIPImageProcessorPil",
    "siglip_vision_model": "SiglipImageProcessorPil",
    "dinov2": "BitImageProcessorPil",
    "dinov2_with_registers": "BitImageProcessorPil",
}

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
            corpus, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials)
        )
        cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
        )
        tok.decoder = decoders.WordPiece()
        return PreTrainedTokenizerFast(
            tokenizer_object=tok,
            unk_token="[UNK]",
            pad_token="[PAD]",
            cls_token="[CLS]",
            sep_token="[SEP]",
            mask_token="[MASK]",
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )


def tiny_config(
    family: str,
    *,
    vocab_size: int = 512,
    d_model: int = 64,
    n_layers: int = 3,
    n_heads: int = 4,
    context: int = 128,
    **overrides,
):
    """The config of a small random model of one family."""
    from transformers import BertConfig, GPT2Config, GPTNeoXConfig, LlamaConfig

    d_mlp = 4 * d_model
    if family == "gpt2":
        cfg = GPT2Config(
            vocab_size=vocab_size,
            n_embd=d_model,
            n_layer=n_layers,
            n_head=n_heads,
            n_positions=context,
            bos_token_id=0,
            eos_token_id=0,
        )
    elif family == "llama":
        cfg = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=d_model,
            intermediate_size=d_mlp,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=max(1, n_heads // 2),
            max_position_embeddings=context,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=None,
        )
    elif family == "gpt_neox":
        cfg = GPTNeoXConfig(
            vocab_size=vocab_size,
            hidden_size=d_model,
            intermediate_size=d_mlp,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            rotary_pct=0.25,
            max_position_embeddings=context,
            use_parallel_residual=True,
            bos_token_id=0,
            eos_token_id=0,
        )
    elif family == "bert":
        cfg = BertConfig(
            vocab_size=vocab_size,
            hidden_size=d_model,
            intermediate_size=d_mlp,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            max_position_embeddings=context,
            pad_token_id=0,
        )
    elif family in VISION_FAMILIES:
        cfg = _vision_config(family, d_model=d_model, n_layers=n_layers, n_heads=n_heads)
    elif family == "mamba":
        from transformers import MambaConfig

        cfg = MambaConfig(
            vocab_size=vocab_size,
            hidden_size=d_model,
            num_hidden_layers=n_layers,
            state_size=8,
            expand=2,
            conv_kernel=4,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
    elif family == "rwkv":
        from transformers import RwkvConfig

        cfg = RwkvConfig(
            vocab_size=vocab_size,
            hidden_size=d_model,
            num_hidden_layers=n_layers,
            attention_hidden_size=d_model,
            intermediate_size=d_mlp,
            context_length=context,
            bos_token_id=0,
            eos_token_id=0,
        )
    elif family in MOE_FAMILIES:
        cfg = _moe_config(
            family,
            vocab_size=vocab_size,
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            context=context,
        )
    else:
        raise ValueError(
            f"unknown family {family!r}; one of {FAMILIES + MOE_FAMILIES + VISION_FAMILIES + SSM_FAMILIES}"
        )
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def _vision_config(family: str, *, d_model: int, n_layers: int, n_heads: int):
    from transformers import AutoConfig

    common = dict(
        hidden_size=d_model,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        image_size=32,
        patch_size=8,
        num_channels=3,
    )
    if family.startswith("dinov2"):
        return AutoConfig.for_model(family, mlp_ratio=2, **common)
    return AutoConfig.for_model(family, intermediate_size=2 * d_model, **common)


def image_processor(family: str):
    """The family's image processor, resizing to the tiny models' 32x32 pixels."""
    import transformers

    cls = getattr(transformers, _IMAGE_PROCESSORS[family])
    if family.startswith(("clip", "dinov2")):  # resize the short side, then crop the centre
        return cls(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return cls(size={"height": 32, "width": 32})


def _moe_config(family: str, *, vocab_size: int, d_model: int, n_layers: int, n_heads: int, context: int):
    from transformers import AutoConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=d_model,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=max(1, n_heads // 2),
        max_position_embeddings=context,
        num_experts_per_tok=2,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    if family == "mixtral":
        return AutoConfig.for_model("mixtral", intermediate_size=2 * d_model, num_local_experts=4, **common)
    extra = {"shared_expert_intermediate_size": 2 * d_model} if family == "qwen2_moe" else {}
    return AutoConfig.for_model(
        family,
        intermediate_size=2 * d_model,
        moe_intermediate_size=d_model,
        num_experts=4,
        norm_topk_prob=family != "olmoe",
        **extra,
        **common,
    )


def build_tiny(family: str, *, seed: int = 0, **config_kwargs):
    """A random-init model (causal LM head except BERT) in eval mode."""
    from transformers import AutoModel, AutoModelForCausalLM

    cfg = tiny_config(family, **config_kwargs)
    torch.manual_seed(seed)
    auto = AutoModel if family == "bert" or family in VISION_FAMILIES else AutoModelForCausalLM
    return auto.from_config(cfg).eval()


def save_tiny(family: str, directory: str | Path, *, seed: int = 0, **config_kwargs) -> Path:
    """Build a tiny model + tokenizer and save both with save_pretrained; returns the directory."""
    directory = Path(directory)
    if family in VISION_FAMILIES:  # no tokenizer: the image processor instead
        build_tiny(family, seed=seed, **config_kwargs).save_pretrained(directory)
        image_processor(family).save_pretrained(directory)
        return directory
    tok = train_tokenizer(config_kwargs.get("vocab_size", 512), bert=family == "bert")
    model = build_tiny(
        family,
        seed=seed,
        vocab_size=len(tok),
        **{k: v for k, v in config_kwargs.items() if k != "vocab_size"},
    )
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
