"""ViT image encoders (`ViTModel`, `ViTForImageClassification`; transformers 5.x layout).

Positions are tokens of the image: position 0 is the CLS token, 1..N the patches in row-major
order (patch p sits at row (p-1) // cols, column (p-1) % cols of the patch grid).
"""

from . import norms
from .base import Arch, build, heads

MODEL_TYPES = ("vit",)
BASE = "vit"
LAYERS = "layers"


def table(config, prefix: str, lm_head: str | None) -> Arch:
    H = config.num_attention_heads
    layer = "layers.{L}"
    return build(
        "vit", prefix, config.num_hidden_layers, layer,
        top={"embed": ("embeddings", "output", None),
             "patch_embed": ("embeddings.patch_embeddings", "output", None)},
        per_layer={
            "resid_pre": (layer, "input", None),
            **norms.entries("ln1", f"{layer}.layernorm_before"),
            "attn.in": (f"{layer}.attention", "input", None),
            "attn.q": (f"{layer}.attention.q_proj", "output", heads(H)),
            "attn.k": (f"{layer}.attention.k_proj", "output", heads(H)),
            "attn.v": (f"{layer}.attention.v_proj", "output", heads(H)),
            "attn.z": (f"{layer}.attention.o_proj", "input", heads(H)),
            "attn.out": (f"{layer}.attention", "output", None),
            "resid_mid": (f"{layer}.layernorm_after", "input", None),
            **norms.entries("ln2", f"{layer}.layernorm_after"),
            "mlp.in": (f"{layer}.mlp", "input", None),
            "mlp.pre": (f"{layer}.mlp.fc1", "output", None),
            "mlp.post": (f"{layer}.mlp.fc2", "input", None),
            "mlp.out": (f"{layer}.mlp", "output", None),
            "resid_post": (layer, "output", None),
        },
        final={"ln_final": ("layernorm", "output", None),
               **({"logits": (f"/{lm_head}", "output", None)} if lm_head else {})},
        n_heads=H, d_model=config.hidden_size,
    )
