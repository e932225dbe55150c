"""Llama-family decoders: Llama, Mistral, Qwen2/3, Gemma (gated MLP, grouped-query attention)."""

from .base import Arch, build, heads

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo", "olmo2")
BASE = "model"
LAYERS = "layers"


def attention(config, mid_norm: str = "post_attention_layernorm") -> dict:
    """The residual stream into the block and its self-attention, as Llama-style decoders name
    them (grouped-query k / v heads); shared with the MoE decoders, whose attention is the same."""
    H = config.num_attention_heads
    KV = getattr(config, "num_key_value_heads", None) or H
    return {
        "resid_pre": ("layers.{L}", "input", None),
        "attn.q": ("layers.{L}.self_attn.q_proj", "output", heads(H)),
        "attn.k": ("layers.{L}.self_attn.k_proj", "output", heads(KV)),
        "attn.v": ("layers.{L}.self_attn.v_proj", "output", heads(KV)),
        "attn.z": ("layers.{L}.self_attn.o_proj", "input", heads(H)),
        "attn.out": ("layers.{L}.self_attn", "output", None),
        "resid_mid": (f"layers.{{L}}.{mid_norm}", "input", None),
    }


def table(config, prefix: str, lm_head: str | None) -> Arch:
    # Gemma 2/3 normalise the attention output before the residual add, so the residual stream
    # between attention and MLP enters pre_feedforward_layernorm instead. OLMo 2 normalises only
    # the sublayer outputs (post_attention_layernorm reads attn.out): its MLP reads the stream.
    mid_norm = {"gemma2": "pre_feedforward_layernorm", "gemma3_text": "pre_feedforward_layernorm",
                "olmo2": "mlp"}.get(config.model_type, "post_attention_layernorm")
    return build(
        config.model_type, prefix, config.num_hidden_layers, "layers.{L}",
        top={"embed": ("embed_tokens", "output", None)},
        per_layer={
            **attention(config, mid_norm),
            "mlp.pre": ("layers.{L}.mlp.gate_proj", "output", None),
            "mlp.pre_linear": ("layers.{L}.mlp.up_proj", "output", None),
            "mlp.post": ("layers.{L}.mlp.down_proj", "input", None),
            "mlp.out": ("layers.{L}.mlp", "output", None),
            "resid_post": ("layers.{L}", "output", None),
        },
        final={"ln_final": ("norm", "output", None),
               **({"logits": (f"/{lm_head}", "output", None)} if lm_head else {})},
        n_heads=config.num_attention_heads, d_model=config.hidden_size,
    )
