"""RWKV (v4, `RwkvModel`, `RwkvForCausalLM`): time mixing (the recurrent "attention") and channel
mixing (the MLP), each read from and added to the residual stream.

`mixer.in` / `mixer.out` are the time-mixing input (after ln1) and output; `mlp.in` / `mlp.out`
the channel mixing's. Block 0 normalises its input first (pre_ln): `blocks.0.resid_pre` is the
raw embedding, as the model receives it. Blocks return (hidden, state, ...): resid_post is item 0.
In inference RWKV halves the stream after every `rescale_every`-th block (outside the block):
there `blocks.{L}.resid_post` is the block's output before the halving, `blocks.{L+1}.resid_pre` after.
"""

from . import norms
from .base import Arch, build, sum_of

MODEL_TYPES = ("rwkv",)
BASE = "rwkv"
LAYERS = "blocks"


def table(config, prefix: str, lm_head: str | None) -> Arch:
    layer = "blocks.{L}"
    return build(
        "rwkv",
        prefix,
        config.num_hidden_layers,
        layer,
        top={"embed": ("embeddings", "output", None)},
        per_layer={
            "resid_pre": (layer, "input", None),
            "mixer.in": (f"{layer}.attention", "input", None),
            "mixer.out": (f"{layer}.attention", "output", None),
            "resid_mid": (f"{layer}.ln2", "input", None, sum_of(f"{layer}.ln1", "mixer.out")),
            "mlp.in": (f"{layer}.feed_forward", "input", None),
            "mlp.out": (f"{layer}.feed_forward", "output", None),
            "resid_post": (layer, "output", None),
        },
        final={
            **norms.entries("ln_final", "ln_out"),
            "ln_final": ("ln_out", "output", None),
            **({"logits": (f"/{lm_head}", "output", None)} if lm_head else {}),
        },
        n_heads=None,
        d_model=config.hidden_size,
    )
