"""DINOv2 image encoders (`Dinov2Model`, `Dinov2ForImageClassification`, `Dinov2Backbone`), read
with ViT's table (vit.py). What differs from ViT: the modules' names; LayerScale, which scales each
sublayer's output before the residual add, so `attn.out` / `mlp.out` are read after it (what is
added to the stream, as TransformerLens means the names) and `attn.out_pre_scale` /
`mlp.out_pre_scale` before it; and, with `use_swiglu_ffn`, a gated MLP: `mlp.pre` is the gate,
`mlp.pre_linear` the up projection.

Position 0 is the CLS token, 1..N the patches in row-major order.
"""

import importlib.metadata
import re

from ..errors import ModelLoadError
from . import vit
from .base import Arch

# with registers: the register tokens sit between CLS and the patches (positions 1..R); only the
# base Dinov2WithRegistersModel is recognised (its classifier holds it under another attribute)
MODEL_TYPES = ("dinov2", "dinov2_with_registers")
BASE = "dinov2"
LAYERS = "encoder.layer"
# the attention's q_proj / k_proj / v_proj / o_proj modules (transformers 5.17 names them query / key /
# value / output.dense): scripts/test-all's floor environment runs 5.17 and checks this error
NEEDS_TRANSFORMERS = (5, 18)

# Points whose meaning differs between hookscope releases: name suffix -> (what it means in this
# release, what it meant in earlier ones). A store records the meaning of such points, so resuming a
# store written with the other meaning is refused (sources/identity.py, store/meanings.py).
MEANING_CHANGES = {
    "attn.out": (
        "what attention adds to the residual stream, after LayerScale (TransformerLens's "
        "meaning of hook_attn_out)",
        "attention's output before LayerScale (now attn.out_pre_scale)",
    ),
    "mlp.out": (
        "what the MLP adds to the residual stream, after LayerScale (TransformerLens's meaning "
        "of hook_mlp_out)",
        "the MLP's output before LayerScale (now mlp.out_pre_scale)",
    ),
}
# earlier releases' names of the LayerScale outputs, still accepted: aliases of attn.out / mlp.out
EARLIER_NAMES = {"attn.scaled": "attn.out", "mlp.scaled": "mlp.out"}


def meaning_changes(model_type: str) -> dict[str, tuple[str, str]]:
    return MEANING_CHANGES


def _check_transformers() -> None:
    version = importlib.metadata.version("transformers")
    if tuple(int(n) for n in re.findall(r"\d+", version)[:2]) < NEEDS_TRANSFORMERS:
        need = ".".join(map(str, NEEDS_TRANSFORMERS))
        raise ModelLoadError(
            f"DINOv2 needs transformers >= {need} (the module names of its attention); "
            f"this is transformers {version}: pip install -U 'transformers>={need}'"
        )


def table(config, prefix: str, lm_head: str | None) -> Arch:
    _check_transformers()
    if config.use_swiglu_ffn:
        mlp = {
            "mlp.pre": ("mlp.gate_proj", "output"),
            "mlp.pre_linear": ("mlp.up_proj", "output"),
            "mlp.post": ("mlp.down_proj", "input"),
        }
    else:
        mlp = {"mlp.pre": ("mlp.fc1", "output"), "mlp.post": ("mlp.fc2", "input")}
    arch = vit.encoder(
        config,
        prefix,
        lm_head,
        layer="encoder.layer.{L}",
        norm_paths=("norm1", "norm2"),
        mlp=mlp,
        layer_scales=("layer_scale1", "layer_scale2"),
    )
    arch.aliases = {
        f"blocks.{L}.{old}": f"blocks.{L}.{new}"
        for L in range(config.num_hidden_layers)
        for old, new in EARLIER_NAMES.items()
    }
    return arch
