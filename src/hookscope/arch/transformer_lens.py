"""TransformerLens models (`HookedTransformer`, and the 4.x `TransformerBridge`): their own
HookPoints are the points, addressed through `hook_dict` (aliases included)."""

from __future__ import annotations

from torch import nn

from ..names import canonical, layer_of
from .base import Arch, PointSpec

# a readable execution order inside a block (hook_dict follows definition order instead)
_ORDER = [
    "resid_pre",
    "attn.in_pre_norm",
    "ln1",
    "attn.in",
    "attn.q_input",
    "attn.k_input",
    "attn.v_input",
    "attn.q",
    "attn.k",
    "attn.v",
    "attn.rot_q",
    "attn.rot_k",
    "attn.attn_scores",
    "attn.pattern",
    "attn.z",
    "attn.result",
    "attn.out",
    "resid_mid",
    "mlp.in_pre_norm",
    "ln2",
    "mlp.in",
    "mlp.pre",
    "mlp.pre_linear",
    "mlp.post",
    "mlp.out",
    "resid_post",
]
_FINAL = ("ln_final.scale", "ln_final.normalized", "ln_final")  # in execution order
# [batch, head, query_pos, key_pos] points
_PATTERN_LIKE = ("attn.attn_scores", "attn.pattern")
_PER_HEAD = (
    "attn.q",
    "attn.k",
    "attn.v",
    "attn.z",
    "attn.result",
    "attn.rot_q",
    "attn.rot_k",
    "attn.in_pre_norm",
    "attn.q_input",
    "attn.k_input",
    "attn.v_input",
)


def is_transformer_lens(model: nn.Module) -> bool:
    return isinstance(getattr(model, "hook_dict", None), dict) and hasattr(model, "cfg")


def _rank(name: str) -> tuple:
    layer = layer_of(name)
    if layer is None:
        if name in _FINAL:
            return (2, _FINAL.index(name), 0, name)
        return (0 if not name.startswith(("ln_final", "unembed", "logits")) else 2, len(_FINAL), 0, name)
    suffix = name.split(".", 2)[2]
    head = suffix.split(".")[0]
    order = (
        _ORDER.index(suffix)
        if suffix in _ORDER
        else next((i for i, s in enumerate(_ORDER) if s.startswith(head)), len(_ORDER))
    )
    return (1, layer, order, name)


def table(model: nn.Module) -> Arch:
    modules: dict[str, nn.Module] = {}
    specs: list[PointSpec] = []
    for tl_name, hook_point in model.hook_dict.items():
        name = canonical(tl_name)
        if name in modules:  # the bridge lists aliases of one HookPoint: keep the first
            continue
        modules[name] = hook_point
        suffix = name.split(".", 2)[2] if layer_of(name) is not None else name
        specs.append(
            PointSpec(
                name=name,
                module=name,
                io="output",
                layer=layer_of(name),
                pos_dim=2 if suffix in _PATTERN_LIKE else 1,
                head_dim=1 if suffix in _PATTERN_LIKE else (2 if suffix in _PER_HEAD else None),
            )
        )
    if isinstance(getattr(model, "ln_final", None), nn.Module) and "ln_final" not in modules:
        # the final norm's output, what the unembedding reads (HookedTransformer hooks only its
        # scale and its input / scale, `ln_final.normalized`): the module's own output
        specs.append(PointSpec(name="ln_final", module="ln_final", io="output"))
    specs.sort(key=lambda s: _rank(s.name))
    specs.append(PointSpec(name="logits", module="", io="output"))
    n_layers = model.cfg.n_layers
    return Arch(
        "transformer_lens",
        {s.name: s for s in specs},
        [f"blocks.{i}" for i in range(n_layers)],
        n_heads=model.cfg.n_heads,
        d_model=model.cfg.d_model,
        modules=modules,
    )
