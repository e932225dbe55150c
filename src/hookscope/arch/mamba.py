"""Mamba state-space models (`MambaModel`, `MambaForCausalLM`; transformers 5.x).

A block is `resid + mixer(norm(resid))`. `mixer.in` / `mixer.out` are the mixer's input (after
the block's RMSNorm) and output; inside the mixer, `mixer.in_proj` is [x | gate] before the
convolution and `mixer.ssm_out` the gated scan output entering `out_proj` (d_inner wide).
Those two live in the pure-torch path, which CPUs (and GPUs without the mamba-ssm kernels) take;
the fused CUDA kernel calls no submodule, so there they are never reached (an error, not a gap).
"""

from . import norms
from .base import Arch, build

MODEL_TYPES = ("mamba", "falcon_mamba")
BASE = "backbone"
LAYERS = "layers"


def table(config, prefix: str, lm_head: str | None) -> Arch:
    layer = "layers.{L}"
    return build(
        config.model_type,
        prefix,
        config.num_hidden_layers,
        layer,
        top={"embed": ("embeddings", "output", None)},
        per_layer={
            "resid_pre": (layer, "input", None),
            "mixer.in": (f"{layer}.mixer", "input", None),
            "mixer.in_proj": (f"{layer}.mixer.in_proj", "output", None),
            "mixer.ssm_out": (f"{layer}.mixer.out_proj", "input", None),
            "mixer.out": (f"{layer}.mixer", "output", None),
            "resid_post": (layer, "output", None),
        },
        final={
            **norms.entries("ln_final", "norm_f"),
            "ln_final": ("norm_f", "output", None),
            **({"logits": (f"/{lm_head}", "output", None)} if lm_head else {}),
        },
        n_heads=None,
        d_model=config.hidden_size,
    )
