"""Mixture-of-experts decoders as transformers 5.x ships them: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.

Attention, the residual stream, ln1 / ln2 and `mlp.in` (the MLP block's input: the router's
input, as [batch, pos, d]) are named as in llama.py. The MLP of a sparse layer is
`mlp.gate` (the router: returns logits, top-k weights, top-k indices, one row per token of the
flattened batch) and `mlp.experts` (every expert fused in 3-D parameters `gate_up_proj`
[E, 2*d_mlp, d] and `down_proj` [E, d, d_mlp], called as `experts(rows, top_k_index,
top_k_weights)`); Qwen2-MoE adds a shared expert. Router and expert points are per token of the
flattened batch ([batch*pos, ...], row = b*pos_len + p, as the model's own `router_logits`), so
they have no position dim.

There is no module per expert, so `mlp.experts.{E}.*` read the experts module's call (its rows,
routing and weights) and recompute expert E on the rows routed to it, in the order the model
takes them (top-k slot, then token). With the eager experts implementation this is the same
arithmetic on the same rows, so the values are equal; `grouped_mm` / `batched_mm` reach them up to
rounding. They are read-only: edit the routing (`mlp.router.routing`, see `hookscope.experts`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import HookscopeError
from . import llama, norms
from .base import Arch, Call, View, build

MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
BASE = "model"
LAYERS = "layers"

FLAT = {"pos_dim": None}  # one row per token of the flattened batch
ROUTER = "layers.{L}.mlp.gate"
EXPERTS = "layers.{L}.mlp.experts"


# --- the routing as one dense tensor ---------------------------------------------------------


def _routing_get(out: tuple) -> Tensor:
    """Router output (logits, weights, indices) -> [tokens, n_experts]: each token's weight on
    each expert, 0 where it is not routed."""
    logits, weights, index = out[0], out[1], out[2]
    return torch.zeros(logits.shape, dtype=weights.dtype, device=weights.device).scatter(-1, index, weights)


def _routing_put(out: tuple, new: Tensor) -> tuple:
    """A dense routing back to (logits, top-k weights, top-k indices), with the model's k."""
    k = out[2].shape[-1]
    if new.numel() and int((new != 0).sum(-1).max()) > k:
        raise HookscopeError(
            f"a routing edit gives some token more than {k} experts (the model's top-k); "
            f"give each token at most {k} non-zero weights"
        )
    index = new.abs().topk(k, dim=-1).indices
    return (out[0], new.gather(-1, index).to(out[1].dtype), index.to(out[2].dtype), *out[3:])


ROUTING = View(_routing_get, _routing_put, "top-k weights scattered to [tokens, n_experts]")


# --- one expert, from the experts module's call ---------------------------------------------


def _arg(call: Call, i: int, name: str) -> Tensor:
    return call.args[i] if len(call.args) > i else call.kwargs[name]


def _routed(call: Call, expert: int) -> Tensor:
    """Flat token indices routed to `expert`, in the model's order (top-k slot, then token)."""
    index = _arg(call, 1, "top_k_index")
    return torch.where(index.T == expert)[1]


def _expert_post(call: Call, expert: int) -> Tensor:
    m = call.module
    layout = (
        getattr(m, "is_transposed", False),
        getattr(m, "has_bias", False),
        getattr(m, "has_gate", True),
        getattr(m, "is_concatenated", True),
    )
    if layout != (False, False, True, True):
        raise HookscopeError(
            f"{type(m).__name__}: per-expert points support the concatenated, untransposed, bias-free "
            "[gate; up] layout (Mixtral, Qwen-MoE, OLMoE); read module:...mlp.experts:output instead"
        )
    rows = _arg(call, 0, "hidden_states")[_routed(call, expert)]
    gate, up = F.linear(rows, m.gate_up_proj[expert]).chunk(2, dim=-1)
    return m.act_fn(gate) * up


def _read_only(raw: Call, new: Tensor) -> Call:
    raise HookscopeError(
        "per-expert points are computed from the experts' weights and cannot be written; edit the "
        "routing instead: hookscope.experts.ablate_expert / force_route"
    )


def expert_view(expert: int, what: str) -> View:
    get = {
        "tokens": lambda call: _routed(call, expert),
        "in": lambda call: _arg(call, 0, "hidden_states")[_routed(call, expert)],
        "post": lambda call: _expert_post(call, expert),
        "out": lambda call: F.linear(_expert_post(call, expert), call.module.down_proj[expert]),
    }[what]
    return View(get, _read_only, f"expert {expert}'s rows, recomputed from the call")


# --- the table --------------------------------------------------------------------------------


def _n_experts(config) -> int:
    return getattr(config, "num_local_experts", None) or config.num_experts


def is_sparse(config, layer: int) -> bool:
    """Qwen2-MoE may keep some layers dense (mlp_only_layers, decoder_sparse_step)."""
    if layer in (getattr(config, "mlp_only_layers", None) or []):
        return False
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return _n_experts(config) > 0 and (layer + 1) % step == 0


def table(config, prefix: str, lm_head: str | None) -> Arch:
    H = config.num_attention_heads
    # mlp.in: what the MLP block reads (after ln2), [batch, pos, d]: the router's input, unflattened
    attention = {
        **llama.attention(config),
        **norms.entries("ln2", "layers.{L}.post_attention_layernorm"),
        "mlp.in": ("layers.{L}.mlp", "input", None),
    }
    sparse = dict(attention)
    if getattr(config, "shared_expert_intermediate_size", 0):  # Qwen2-MoE: runs before the router
        shared = "layers.{L}.mlp.shared_expert"
        sparse.update(
            {
                "mlp.shared.pre": (f"{shared}.gate_proj", "output", None, FLAT),
                "mlp.shared.pre_linear": (f"{shared}.up_proj", "output", None, FLAT),
                "mlp.shared.post": (f"{shared}.down_proj", "input", None, FLAT),
                "mlp.shared.out": (shared, "output", None, FLAT),
            }
        )
    sparse.update(
        {
            "mlp.router.logits": (ROUTER, "output", None, {**FLAT, "item": 0}),
            "mlp.router.weights": (ROUTER, "output", None, {**FLAT, "item": 1}),
            "mlp.router.indices": (ROUTER, "output", None, {**FLAT, "item": 2}),
            "mlp.router.routing": (ROUTER, "output", ROUTING, {**FLAT, "item": None}),
        }
    )
    for e in range(_n_experts(config)):
        for what in ("tokens", "in", "post", "out"):
            view = expert_view(e, what)
            sparse[f"mlp.experts.{e}.{what}"] = (EXPERTS, "input", view, {**FLAT, "item": None})
    sparse["mlp.experts.out"] = (EXPERTS, "output", None, FLAT)
    if getattr(config, "shared_expert_intermediate_size", 0):
        sparse["mlp.shared.gate"] = ("layers.{L}.mlp.shared_expert_gate", "output", None, FLAT)
    tail = {"mlp.out": ("layers.{L}.mlp", "output", None), "resid_post": ("layers.{L}", "output", None)}
    sparse.update(tail)
    dense = {
        **attention,
        "mlp.pre": ("layers.{L}.mlp.gate_proj", "output", None),
        "mlp.pre_linear": ("layers.{L}.mlp.up_proj", "output", None),
        "mlp.post": ("layers.{L}.mlp.down_proj", "input", None),
        **tail,
    }

    final = {
        **norms.entries("ln_final", "norm"),
        "ln_final": ("norm", "output", None),
        **({"logits": (f"/{lm_head}", "output", None)} if lm_head else {}),
    }
    args = (config.model_type, prefix, config.num_hidden_layers, "layers.{L}")
    kw = {
        "top": {"embed": ("embed_tokens", "output", None)},
        "final": final,
        "n_heads": H,
        "d_model": config.hidden_size,
    }
    arch = build(*args, per_layer=sparse, **kw)
    if all(is_sparse(config, L) for L in range(config.num_hidden_layers)):
        return arch
    dense_arch = build(*args, per_layer=dense, **kw)
    by_layer: dict[int | None, dict] = {}
    for source in (arch, dense_arch):
        for name, spec in source.specs.items():
            if spec.layer is None or is_sparse(config, spec.layer) == (source is arch):
                by_layer.setdefault(spec.layer, {})[name] = spec
    specs = {n: s for n, s in by_layer[None].items() if n in kw["top"]}
    for layer in range(config.num_hidden_layers):  # execution order
        specs.update(by_layer[layer])
    specs.update({n: s for n, s in by_layer[None].items() if n in final})
    arch.specs = specs
    return arch
