"""CLIP and SigLIP vision towers (`CLIPVisionModel`, `SiglipVisionModel`, and the vision half of
`CLIPModel` / `SiglipModel` / `*WithProjection`, under `vision_model.`).

CLIP: position 0 is the class token, 1..N the patches in row-major order; `embed` is the
embeddings before `pre_layrnorm`, so `blocks.0.resid_pre` is the normalised embeddings. SigLIP
has no class token: positions 0..N-1 are the patches.
"""

from . import norms
from .base import Arch, build, heads, sum_of

MODEL_TYPES = ("clip_vision_model", "siglip_vision_model", "clip", "siglip")
BASE = "vision_model"
LAYERS = "encoder.layers"


def table(config, prefix: str, lm_head: str | None) -> Arch:
    config = getattr(config, "vision_config", None) or config  # a two-tower model: its vision tower
    H = config.num_attention_heads
    layer = "encoder.layers.{L}"
    family = "siglip" if config.model_type.startswith("siglip") else "clip"
    return build(
        family,
        prefix,
        config.num_hidden_layers,
        layer,
        top={"embed": ("embeddings", "output", None)},
        per_layer={
            "resid_pre": (layer, "input", None),
            **norms.entries("ln1", f"{layer}.layer_norm1"),
            "attn.in": (f"{layer}.self_attn", "input", None),
            "attn.q": (f"{layer}.self_attn.q_proj", "output", heads(H)),
            "attn.k": (f"{layer}.self_attn.k_proj", "output", heads(H)),
            "attn.v": (f"{layer}.self_attn.v_proj", "output", heads(H)),
            "attn.z": (f"{layer}.self_attn.out_proj", "input", heads(H)),
            "attn.out": (f"{layer}.self_attn", "output", None),
            "resid_mid": (f"{layer}.layer_norm2", "input", None, sum_of(f"{layer}.layer_norm1", "attn.out")),
            **norms.entries("ln2", f"{layer}.layer_norm2"),
            "mlp.in": (f"{layer}.mlp", "input", None),
            "mlp.pre": (f"{layer}.mlp.fc1", "output", None),
            "mlp.post": (f"{layer}.mlp.fc2", "input", None),
            "mlp.out": (f"{layer}.mlp", "output", None),
            "resid_post": (layer, "output", None),
        },
        final={"ln_final": ("post_layernorm", "output", None)},
        n_heads=H,
        d_model=config.hidden_size,
    )
