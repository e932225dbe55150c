"""BERT-style encoders (BERT, MiniLM).

BERT blocks are post-LayerNorm: each sublayer adds to the residual and then normalises. Here
`resid_mid` / `resid_post` are the normalised values, i.e. what the next sublayer / block reads
(so `blocks.{L}.resid_post == blocks.{L+1}.resid_pre`, which extraction relies on).
TransformerLens's BERT records them before the LayerNorm instead; the raw sums are reachable
as `module:encoder.layer.{L}.output.LayerNorm:input`. There is no final LayerNorm.
"""

from .base import Arch, build, heads

MODEL_TYPES = ("bert",)
BASE = "bert"
LAYERS = "encoder.layer"


def table(config, prefix: str, lm_head: str | None) -> Arch:
    H = config.num_attention_heads
    layer = "encoder.layer.{L}"
    return build(
        "bert",
        prefix,
        config.num_hidden_layers,
        layer,
        top={
            "embed": ("embeddings.word_embeddings", "output", None),
            "pos_embed": ("embeddings.position_embeddings", "output", None),
        },
        per_layer={
            "resid_pre": (layer, "input", None),
            "attn.in": (f"{layer}.attention", "input", None),
            "attn.q": (f"{layer}.attention.self.query", "output", heads(H)),
            "attn.k": (f"{layer}.attention.self.key", "output", heads(H)),
            "attn.v": (f"{layer}.attention.self.value", "output", heads(H)),
            "attn.z": (f"{layer}.attention.output.dense", "input", heads(H)),
            "attn.out": (f"{layer}.attention.output.dense", "output", None),
            "resid_mid": (f"{layer}.attention", "output", None),
            "mlp.in": (f"{layer}.intermediate", "input", None),
            "mlp.pre": (f"{layer}.intermediate.dense", "output", None),
            "mlp.post": (f"{layer}.intermediate", "output", None),
            "mlp.out": (f"{layer}.output.dense", "output", None),
            "resid_post": (layer, "output", None),
        },
        final={},
        n_heads=H,
        d_model=config.hidden_size,
    )
