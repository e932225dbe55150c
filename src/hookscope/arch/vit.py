"""ViT-style image encoders: ViT (`ViTModel`, `ViTForImageClassification`; transformers 5.x layout)
here, and DINOv2 (dinov2.py) through the same table, which names what DINOv2 does differently.

Positions are tokens of the image: position 0 is the CLS token, 1..N the patches in row-major
order (patch p sits at row (p-1) // cols, column (p-1) % cols of the patch grid).
"""

from . import norms
from .base import Arch, build, heads, sum_of

MODEL_TYPES = ("vit",)
BASE = "vit"
LAYERS = "layers"


def table(config, prefix: str, lm_head: str | None) -> Arch:
    return encoder(
        config,
        prefix,
        lm_head,
        layer="layers.{L}",
        norm_paths=("layernorm_before", "layernorm_after"),
        mlp={"mlp.pre": ("mlp.fc1", "output"), "mlp.post": ("mlp.fc2", "input")},
    )


def encoder(
    config,
    prefix: str,
    lm_head: str | None,
    *,
    layer: str,
    norm_paths: tuple[str, str],
    mlp: dict[str, tuple[str, str]],
    layer_scales: tuple[str, str] | None = None,
) -> Arch:
    """The table of a pre-norm encoder with ViT's embeddings and attention. What differs from one
    family to the next: the block's path `layer`, its two norms (`norm_paths`, in the block), the
    MLP's points (`mlp`: name -> (path in the block, side)), and `layer_scales`: the modules that
    scale each sublayer's output before the residual add (DINOv2's LayerScale). With them,
    `attn.out` / `mlp.out` are what is added to the residual stream (after the scale,
    TransformerLens's meaning), and the sublayers' own outputs are `attn.out_pre_scale` /
    `mlp.out_pre_scale`."""
    H = config.num_attention_heads
    ln1, ln2 = (f"{layer}.{n}" for n in norm_paths)

    def out(name: str, sublayer: str, scale: str | None) -> dict:
        if scale is None:
            return {name: (f"{layer}.{sublayer}", "output", None)}
        return {
            f"{name}_pre_scale": (f"{layer}.{sublayer}", "output", None),
            name: (f"{layer}.{scale}", "output", None),
        }

    attn_scale, mlp_scale = layer_scales or (None, None)
    return build(
        config.model_type,
        prefix,
        config.num_hidden_layers,
        layer,
        top={
            "embed": ("embeddings", "output", None),
            "patch_embed": ("embeddings.patch_embeddings", "output", None),
        },
        per_layer={
            "resid_pre": (layer, "input", None),
            **norms.entries("ln1", ln1),
            "attn.in": (f"{layer}.attention", "input", None),
            "attn.q": (f"{layer}.attention.q_proj", "output", heads(H)),
            "attn.k": (f"{layer}.attention.k_proj", "output", heads(H)),
            "attn.v": (f"{layer}.attention.v_proj", "output", heads(H)),
            "attn.z": (f"{layer}.attention.o_proj", "input", heads(H)),
            **out("attn.out", "attention", attn_scale),
            "resid_mid": (ln2, "input", None, sum_of(ln1, "attn.out")),
            **norms.entries("ln2", ln2),
            "mlp.in": (f"{layer}.mlp", "input", None),
            **{name: (f"{layer}.{path}", io, None) for name, (path, io) in mlp.items()},
            **out("mlp.out", "mlp", mlp_scale),
            "resid_post": (layer, "output", None),
        },
        final={
            **norms.entries("ln_final", "layernorm"),
            "ln_final": ("layernorm", "output", None),
            **({"logits": (f"/{lm_head}", "output", None)} if lm_head else {}),
        },
        n_heads=H,
        d_model=config.hidden_size,
    )
