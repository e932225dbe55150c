"""GPT-2 (Hugging Face `GPT2Model` / `GPT2LMHeadModel`)."""

from . import norms
from .base import Arch, build, fused_heads, heads, sum_of

MODEL_TYPES = ("gpt2",)
BASE = "transformer"  # attribute holding the base model on *LMHeadModel
LAYERS = "h"


def table(config, prefix: str, lm_head: str | None) -> Arch:
    H = config.n_head
    return build(
        "gpt2",
        prefix,
        config.n_layer,
        "h.{L}",
        top={"embed": ("wte", "output", None), "pos_embed": ("wpe", "output", None)},
        per_layer={
            "resid_pre": ("h.{L}", "input", None),
            **norms.entries("ln1", "h.{L}.ln_1"),
            "attn.in": ("h.{L}.attn", "input", None),
            "attn.q": ("h.{L}.attn.c_attn", "output", fused_heads(0, 3, H)),
            "attn.k": ("h.{L}.attn.c_attn", "output", fused_heads(1, 3, H)),
            "attn.v": ("h.{L}.attn.c_attn", "output", fused_heads(2, 3, H)),
            "attn.z": ("h.{L}.attn.c_proj", "input", heads(H)),
            "attn.out": ("h.{L}.attn", "output", None),
            "resid_mid": ("h.{L}.ln_2", "input", None, sum_of("h.{L}.ln_1", "attn.out")),
            **norms.entries("ln2", "h.{L}.ln_2"),
            "mlp.in": ("h.{L}.mlp", "input", None),
            "mlp.pre": ("h.{L}.mlp.c_fc", "output", None),
            "mlp.post": ("h.{L}.mlp.c_proj", "input", None),
            "mlp.out": ("h.{L}.mlp", "output", None),
            "resid_post": ("h.{L}", "output", None),
        },
        final={
            **norms.entries("ln_final", "ln_f"),
            "ln_final": ("ln_f", "output", None),
            **({"logits": (f"/{lm_head}", "output", None)} if lm_head else {}),
        },
        n_heads=H,
        d_model=config.n_embd,
    )
