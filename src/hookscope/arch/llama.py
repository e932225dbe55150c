"""Llama-family decoders: Llama, Mistral, Qwen2/3, Gemma, Gemma 2/3, OLMo, OLMo 2 (gated MLP,
grouped-query attention).

Names mean what TransformerLens means: `attn.out` / `mlp.out` are what each sublayer adds to the
residual stream. Gemma 2/3 and OLMo 2 normalise a sublayer's output before that add (Gemma's
sandwich norms, OLMo 2's post-norms): there `attn.out` / `mlp.out` are the post-norm outputs
(`post_attention_layernorm` / `post_feedforward_layernorm`), and the sublayers' own outputs are
`attn.out_pre_norm` / `mlp.out_pre_norm` (the bridge's `blocks.L.attn.hook_out` / `mlp.hook_out`).
`attn.in` / `mlp.in` are what attention / the MLP read (after ln1 / ln2); OLMo 2 has no ln1 / ln2:
its sublayers read the residual stream itself.
"""

from . import norms
from .base import Arch, build, heads, sum_of

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo", "olmo2")
BASE = "model"
LAYERS = "layers"

# model type -> (ln2's module or None, post-attention norm, post-MLP norm) where they differ from Llama
_POST_NORMED = {
    "gemma2": ("pre_feedforward_layernorm", "post_attention_layernorm", "post_feedforward_layernorm"),
    "gemma3_text": ("pre_feedforward_layernorm", "post_attention_layernorm", "post_feedforward_layernorm"),
    "olmo2": (None, "post_attention_layernorm", "post_feedforward_layernorm"),
}


# Points of the post-normed families whose meaning differs between hookscope releases: name suffix
# -> (what it means in this release, what it meant in earlier ones). A store records the meaning of
# such points, so resuming a store written with the other meaning is refused (sources/identity.py,
# store/meanings.py).
MEANING_CHANGES = {
    "attn.out": (
        "what attention adds to the residual stream, after its post-norm (TransformerLens hook_attn_out)",
        "attention's output before its post-norm (now attn.out_pre_norm)",
    ),
    "mlp.out": (
        "what the MLP adds to the residual stream, after its post-norm (TransformerLens hook_mlp_out)",
        "the MLP's output before its post-norm (now mlp.out_pre_norm)",
    ),
}


def meaning_changes(model_type: str) -> dict[str, tuple[str, str]]:
    return MEANING_CHANGES if model_type in _POST_NORMED else {}


def attention(
    config,
    ln1: str | None = "input_layernorm",
    post_norm: str | None = None,
    mid: str = "layers.{L}.post_attention_layernorm",
) -> dict:
    """The residual stream into the block and its self-attention, as Llama-style decoders name
    them (grouped-query k / v heads); shared with the MoE decoders, whose attention is the same.
    `post_norm`: the norm between attention and the residual add, if any; `mid`: a module whose
    input is resid_mid."""
    H = config.num_attention_heads
    KV = getattr(config, "num_key_value_heads", None) or H
    attn = "layers.{L}.self_attn"
    out = (
        {
            "attn.out_pre_norm": (attn, "output", None),
            "attn.out": (f"layers.{{L}}.{post_norm}", "output", None),
        }
        if post_norm
        else {"attn.out": (attn, "output", None)}
    )
    return {
        "resid_pre": ("layers.{L}", "input", None),
        **(norms.entries("ln1", f"layers.{{L}}.{ln1}") if ln1 else {}),
        "attn.in": (attn, "input", None),
        "attn.q": (f"{attn}.q_proj", "output", heads(H)),
        "attn.k": (f"{attn}.k_proj", "output", heads(KV)),
        "attn.v": (f"{attn}.v_proj", "output", heads(KV)),
        "attn.z": (f"{attn}.o_proj", "input", heads(H)),
        **out,
        # the stream entering ln1 (OLMo 2: attention itself) plus attention's contribution
        "resid_mid": (mid, "input", None, sum_of(f"layers.{{L}}.{ln1}" if ln1 else attn, "attn.out")),
    }


def table(config, prefix: str, lm_head: str | None) -> Arch:
    ln2, attn_norm, mlp_norm = _POST_NORMED.get(config.model_type, ("post_attention_layernorm", None, None))
    # resid_mid enters ln2; OLMo 2 has none: its MLP reads the stream itself
    mid = f"layers.{{L}}.{ln2}" if ln2 else "layers.{L}.mlp"
    mlp_out = (
        {
            "mlp.out_pre_norm": ("layers.{L}.mlp", "output", None),
            "mlp.out": (f"layers.{{L}}.{mlp_norm}", "output", None),
        }
        if mlp_norm
        else {"mlp.out": ("layers.{L}.mlp", "output", None)}
    )
    return build(
        config.model_type,
        prefix,
        config.num_hidden_layers,
        "layers.{L}",
        top={"embed": ("embed_tokens", "output", None)},
        per_layer={
            **attention(config, "input_layernorm" if config.model_type != "olmo2" else None, attn_norm, mid),
            **(norms.entries("ln2", f"layers.{{L}}.{ln2}") if ln2 else {}),
            "mlp.in": ("layers.{L}.mlp", "input", None),
            "mlp.pre": ("layers.{L}.mlp.gate_proj", "output", None),
            "mlp.pre_linear": ("layers.{L}.mlp.up_proj", "output", None),
            "mlp.post": ("layers.{L}.mlp.down_proj", "input", None),
            **mlp_out,
            "resid_post": ("layers.{L}", "output", None),
        },
        final={
            **norms.entries("ln_final", "norm"),
            "ln_final": ("norm", "output", None),
            **({"logits": (f"/{lm_head}", "output", None)} if lm_head else {}),
        },
        n_heads=config.num_attention_heads,
        d_model=config.hidden_size,
    )
