"""DINOv2 image encoders (`Dinov2Model`, `Dinov2ForImageClassification`, `Dinov2Backbone`).

Position 0 is the CLS token, 1..N the patches in row-major order. A DINOv2 block scales each
sublayer's output (LayerScale) before adding it to the residual: `attn.out` / `mlp.out` are the
sublayer outputs before that scale, `attn.scaled` / `mlp.scaled` what is added to the residual.
With `use_swiglu_ffn` the MLP is gated: `mlp.pre` is the gate, `mlp.pre_linear` the up projection.
"""

import importlib.metadata
import re

from ..errors import ModelLoadError
from . import norms
from .base import Arch, build, heads

# with registers: the register tokens sit between CLS and the patches (positions 1..R); only the
# base Dinov2WithRegistersModel is recognised (its classifier holds it under another attribute)
MODEL_TYPES = ("dinov2", "dinov2_with_registers")
BASE = "dinov2"
LAYERS = "encoder.layer"
# the attention's q_proj / k_proj / v_proj / o_proj modules (transformers 5.17 names them query / key /
# value / output.dense): scripts/test-all's floor environment runs 5.17 and checks this error
NEEDS_TRANSFORMERS = (5, 18)


def _check_transformers() -> None:
    version = importlib.metadata.version("transformers")
    if tuple(int(n) for n in re.findall(r"\d+", version)[:2]) < NEEDS_TRANSFORMERS:
        need = ".".join(map(str, NEEDS_TRANSFORMERS))
        raise ModelLoadError(f"DINOv2 needs transformers >= {need} (the module names of its attention); "
                             f"this is transformers {version}: pip install -U 'transformers>={need}'")


def table(config, prefix: str, lm_head: str | None) -> Arch:
    _check_transformers()
    H = config.num_attention_heads
    layer = "encoder.layer.{L}"
    if config.use_swiglu_ffn:
        mlp = {"mlp.pre": (f"{layer}.mlp.gate_proj", "output", None),
               "mlp.pre_linear": (f"{layer}.mlp.up_proj", "output", None),
               "mlp.post": (f"{layer}.mlp.down_proj", "input", None)}
    else:
        mlp = {"mlp.pre": (f"{layer}.mlp.fc1", "output", None),
               "mlp.post": (f"{layer}.mlp.fc2", "input", None)}
    return build(
        config.model_type, prefix, config.num_hidden_layers, layer,
        top={"embed": ("embeddings", "output", None),
             "patch_embed": ("embeddings.patch_embeddings", "output", None)},
        per_layer={
            "resid_pre": (layer, "input", None),
            **norms.entries("ln1", f"{layer}.norm1"),
            "attn.in": (f"{layer}.attention", "input", None),
            "attn.q": (f"{layer}.attention.q_proj", "output", heads(H)),
            "attn.k": (f"{layer}.attention.k_proj", "output", heads(H)),
            "attn.v": (f"{layer}.attention.v_proj", "output", heads(H)),
            "attn.z": (f"{layer}.attention.o_proj", "input", heads(H)),
            "attn.out": (f"{layer}.attention", "output", None),
            "attn.scaled": (f"{layer}.layer_scale1", "output", None),
            "resid_mid": (f"{layer}.norm2", "input", None),
            **norms.entries("ln2", f"{layer}.norm2"),
            "mlp.in": (f"{layer}.mlp", "input", None),
            **mlp,
            "mlp.out": (f"{layer}.mlp", "output", None),
            "mlp.scaled": (f"{layer}.layer_scale2", "output", None),
            "resid_post": (layer, "output", None),
        },
        final={"ln_final": ("layernorm", "output", None),
               **({"logits": (f"/{lm_head}", "output", None)} if lm_head else {})},
        n_heads=H, d_model=config.hidden_size,
    )
