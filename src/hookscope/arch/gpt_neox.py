"""GPT-NeoX / Pythia (fused, per-head interleaved q|k|v; usually a parallel residual)."""

from . import norms
from .base import Arch, build, fused_heads, heads, sum_of

MODEL_TYPES = ("gpt_neox",)
BASE = "gpt_neox"
LAYERS = "layers"


def table(config, prefix: str, lm_head: str | None) -> Arch:
    H = config.num_attention_heads
    qkv = "layers.{L}.attention.query_key_value"
    per_layer = {
        "resid_pre": ("layers.{L}", "input", None),
        **norms.entries("ln1", "layers.{L}.input_layernorm"),
        "attn.in": ("layers.{L}.attention", "input", None),
        "attn.q": (qkv, "output", fused_heads(0, 3, H, interleaved=True)),
        "attn.k": (qkv, "output", fused_heads(1, 3, H, interleaved=True)),
        "attn.v": (qkv, "output", fused_heads(2, 3, H, interleaved=True)),
        "attn.z": ("layers.{L}.attention.dense", "input", heads(H)),
        "attn.out": ("layers.{L}.attention", "output", None),
        # with a parallel residual (Pythia) attention and MLP both read resid_pre: no resid_mid
        **(
            {}
            if config.use_parallel_residual
            else {
                "resid_mid": (
                    "layers.{L}.post_attention_layernorm",
                    "input",
                    None,
                    sum_of("layers.{L}.input_layernorm", "attn.out"),
                )
            }
        ),
        **norms.entries("ln2", "layers.{L}.post_attention_layernorm"),
        "mlp.in": ("layers.{L}.mlp", "input", None),
        "mlp.pre": ("layers.{L}.mlp.dense_h_to_4h", "output", None),
        "mlp.post": ("layers.{L}.mlp.dense_4h_to_h", "input", None),
        "mlp.out": ("layers.{L}.mlp", "output", None),
        "resid_post": ("layers.{L}", "output", None),
    }
    return build(
        "gpt_neox",
        prefix,
        config.num_hidden_layers,
        "layers.{L}",
        top={"embed": ("embed_in", "output", None)},
        per_layer=per_layer,
        final={
            **norms.entries("ln_final", "final_layer_norm"),
            "ln_final": ("final_layer_norm", "output", None),
            **({"logits": (f"/{lm_head}", "output", None)} if lm_head else {}),
        },
        n_heads=H,
        d_model=config.hidden_size,
    )
