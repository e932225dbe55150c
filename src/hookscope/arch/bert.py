"""BERT-style encoders (BERT, MiniLM): post-LayerNorm blocks, so resid_mid is the attention
sublayer's normalised output and there is no final LayerNorm."""

from .base import Arch, build, heads

MODEL_TYPES = ("bert",)
BASE = "bert"
LAYERS = "encoder.layer"


def table(config, prefix: str, lm_head: str | None) -> Arch:
    H = config.num_attention_heads
    layer = "encoder.layer.{L}"
    return build(
        "bert", prefix, config.num_hidden_layers, layer,
        top={
            "embed": ("embeddings.word_embeddings", "output", None),
            "pos_embed": ("embeddings.position_embeddings", "output", None),
        },
        per_layer={
            "resid_pre": (layer, "input", None),
            "attn.q": (f"{layer}.attention.self.query", "output", heads(H)),
            "attn.k": (f"{layer}.attention.self.key", "output", heads(H)),
            "attn.v": (f"{layer}.attention.self.value", "output", heads(H)),
            "attn.z": (f"{layer}.attention.output.dense", "input", heads(H)),
            "attn.out": (f"{layer}.attention.output.dense", "output", None),
            "resid_mid": (f"{layer}.attention", "output", None),
            "mlp.pre": (f"{layer}.intermediate.dense", "output", None),
            "mlp.post": (f"{layer}.intermediate", "output", None),
            "mlp.out": (f"{layer}.output.dense", "output", None),
            "resid_post": (layer, "output", None),
        },
        final={},
        n_heads=H, d_model=config.hidden_size,
    )
