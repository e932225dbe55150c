"""Tiny random models of every family hookscope has a table for, built in memory (no tokenizer,
no disk), in float64 and with every parameter nudged off its initial value, so that no two
points are equal by accident: a LayerScale of exactly 1, a zero bias or a unit norm weight would
make `attn.out` equal `attn.out_pre_scale`, or a module's input equal its output, and hide a wrong table
entry. Used by test_relations.py and scripts/mutate-tables."""

from __future__ import annotations

import torch
from torch import nn

from hookscope.testing import tiny_config

D_MODEL, N_LAYERS, N_HEADS, VOCAB = 32, 2, 4, 300

# Llama-style decoders that hookscope reads with arch/llama.py, built from their own configs
LLAMA_LIKE = ("mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo", "olmo2")
# case -> (model type or tiny_config family, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "gpt2": ("gpt2", {}),
    "llama": ("llama", {}),
    **{mt: (mt, {}) for mt in LLAMA_LIKE},
    "neox_parallel": ("gpt_neox", {"use_parallel_residual": True}),
    "neox_sequential": ("gpt_neox", {"use_parallel_residual": False}),
    "bert": ("bert", {}),
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "olmoe": ("olmoe", {}),
    "vit": ("vit", {}),
    "clip": ("clip_vision_model", {}),
    "siglip": ("siglip_vision_model", {}),
    "dinov2": ("dinov2", {}),
    "dinov2_swiglu": ("dinov2", {"use_swiglu_ffn": True}),
    "dinov2_with_registers": ("dinov2_with_registers", {}),
    "mamba": ("mamba", {}),
    "falcon_mamba": ("falcon_mamba", {}),
    "rwkv": ("rwkv", {}),
}
VISION = {"vit", "clip", "siglip", "dinov2", "dinov2_swiglu", "dinov2_with_registers"}
ENCODERS = VISION | {"bert"}


def _config(kind: str, overrides: dict):
    from transformers import AutoConfig

    if kind == "mamba":  # the residual sum in float64 like the rest (the default adds in float32)
        overrides = {**overrides, "residual_in_fp32": False}
    if kind not in LLAMA_LIKE and kind != "falcon_mamba":
        return tiny_config(
            kind,
            vocab_size=VOCAB,
            d_model=D_MODEL,
            n_layers=N_LAYERS,
            n_heads=N_HEADS,
            context=64,
            **overrides,
        )
    if kind == "falcon_mamba":
        return AutoConfig.for_model(
            kind,
            vocab_size=VOCAB,
            hidden_size=D_MODEL,
            num_hidden_layers=N_LAYERS,
            state_size=8,
            expand=2,
            conv_kernel=4,
            residual_in_fp32=False,
        )
    # logits = lm_head(ln_final); a case's overrides last
    extra = {"final_logit_softcapping": None, **overrides} if kind == "gemma2" else overrides
    shape = {
        "vocab_size": VOCAB,
        "hidden_size": D_MODEL,
        "intermediate_size": 2 * D_MODEL,
        "num_hidden_layers": N_LAYERS,
        "num_attention_heads": N_HEADS,
        "num_key_value_heads": N_HEADS // 2,
        "head_dim": D_MODEL // N_HEADS,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": None,
    }
    return AutoConfig.for_model(kind, **{**shape, **extra})


def build(case: str, seed: int = 0, **settings: object) -> nn.Module:
    """The case's tiny model: eval mode, eager attention (attn.pattern), float64, nudged;
    `settings`: config values over the case's own."""
    from transformers import AutoModel, AutoModelForCausalLM

    kind, overrides = CASES[case]
    config = _config(kind, {**overrides, **settings})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    auto = AutoModel if case in ENCODERS else AutoModelForCausalLM
    model = auto.from_config(config).eval().double()
    if hasattr(model.config, "_experts_implementation"):
        model.config._experts_implementation = "eager"
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


def inputs(case: str, seed: int = 1) -> dict:
    """A batch of 2: token ids of 7 tokens, or 32x32 pictures."""
    g = torch.Generator().manual_seed(seed)
    if case in VISION:
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g, dtype=torch.float64)}
    return {"input_ids": torch.randint(0, VOCAB, (2, 7), generator=g)}
