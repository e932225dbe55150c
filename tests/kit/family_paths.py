"""Hand-written module paths of the MoE, vision and state-space families, for the family tests'
references: each point's Hugging Face module, the side of it, and how to read the point from
the hooked tensor. Written from the models' module trees, never from hookscope's tables; where
the same tensor is also another module's output or input (an activation's output is the down
projection's input), the path here takes the other one. `reference` runs one forward pass with
plain `register_forward_hook` / `register_forward_pre_hook` on them (helpers.plain_hooks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from helpers import plain_hooks
from torch import Tensor, nn

OUT, IN = "output", "input"
Path = tuple[str, str, Callable[[Any], Tensor]]


def same(x: Tensor) -> Tensor:
    return x


def item(i: int) -> Callable[[tuple], Tensor]:
    return lambda output: output[i]


def per_head(n: int, read: Callable = same) -> Callable[[Any], Tensor]:
    return lambda x: read(x).unflatten(-1, (n, -1))


def _norm(model: nn.Module, p: str, ln: str, path: str) -> dict[str, Path]:
    """TransformerLens's `ln.scale` / `ln.normalized` (before weight and bias) from the input of
    the norm at `path`, by hand; what the sublayer reads is the norm's output."""
    return _normalized(model, p + ln, path) | {p + {"ln1": "attn.in", "ln2": "mlp.in"}[ln]: (path, OUT, same)}


def _normalized(model: nn.Module, ln: str, path: str) -> dict[str, Path]:
    """`{ln}.scale` / `{ln}.normalized` of the norm at `path`, by hand from its input."""
    norm = model.get_submodule(path)
    eps = getattr(norm, "eps", None) or norm.variance_epsilon
    centre = "RMS" not in type(norm).__name__

    def centred(x: Tensor) -> Tensor:
        return x - x.mean(-1, keepdim=True) if centre else x

    def scale(x: Tensor) -> Tensor:
        return (centred(x).pow(2).mean(-1, keepdim=True) + eps).sqrt()

    return {ln + ".scale": (path, IN, scale), ln + ".normalized": (path, IN, lambda x: centred(x) / scale(x))}


def _attention(p: str, attn: str, o: str, n_heads: int, n_kv: int) -> dict[str, Path]:
    """The per-head points of a self-attention module (q_proj, k_proj, v_proj and the output
    projection `o`): projections' outputs, the output projection's input, the module's
    (output, weights)."""
    return {
        p + "attn.q": (f"{attn}.q_proj", OUT, per_head(n_heads)),
        p + "attn.k": (f"{attn}.k_proj", OUT, per_head(n_kv)),
        p + "attn.v": (f"{attn}.v_proj", OUT, per_head(n_kv)),
        p + "attn.pattern": (attn, OUT, item(1)),
        p + "attn.z": (f"{attn}.{o}", IN, per_head(n_heads)),
        p + "attn.out": (attn, OUT, item(0)),
    }


# --- image encoders ---------------------------------------------------------------------------


def vision_paths(model: nn.Module, prefix: str = "") -> dict[str, Path]:
    """ViT, CLIP / SigLIP (towers under `prefix`, e.g. "vision_model."), DINOv2 (+ registers)."""
    cfg = getattr(model.config, "vision_config", None) or model.config
    kind, H = cfg.model_type, cfg.num_attention_heads
    # blocks, their two norms, attention and its output projection, the final norm
    layers, norms, attn, o, final = {
        "vit": ("layers", ("layernorm_before", "layernorm_after"), "attention", "o_proj", "layernorm"),
        "dinov2": ("encoder.layer", ("norm1", "norm2"), "attention", "o_proj", "layernorm"),
        "clip": ("encoder.layers", ("layer_norm1", "layer_norm2"), "self_attn", "out_proj", "post_layernorm"),
    }[kind.split("_")[0].replace("siglip", "clip")]
    paths: dict[str, Path] = {"embed": (prefix + "embeddings", OUT, same)}
    if kind == "vit" or kind.startswith("dinov2"):
        paths["patch_embed"] = (prefix + "embeddings.patch_embeddings", OUT, same)
    for L in range(cfg.num_hidden_layers):
        p, blk = f"blocks.{L}.", f"{prefix}{layers}.{L}"
        paths[p + "resid_pre"] = (f"{blk}.{norms[0]}", IN, same)
        paths |= _norm(model, p, "ln1", f"{blk}.{norms[0]}") | _norm(model, p, "ln2", f"{blk}.{norms[1]}")
        paths |= _attention(p, f"{blk}.{attn}", o, H, H)
        paths |= {
            p + "resid_mid": (f"{blk}.{norms[1]}", IN, same),
            p + "mlp.pre": (f"{blk}.mlp.fc1", OUT, same),
            p + "mlp.post": (f"{blk}.mlp.activation_fn", OUT, same),
            p + "mlp.out": (f"{blk}.mlp", OUT, same),
            p + "resid_post": (blk, OUT, same),
        }
        if kind.startswith("dinov2"):  # what is added to the stream: after LayerScale
            paths[p + "attn.out_pre_scale"] = paths[p + "attn.out"]
            paths[p + "mlp.out_pre_scale"] = paths[p + "mlp.out"]
            paths[p + "attn.out"] = (f"{blk}.layer_scale1", OUT, same)
            paths[p + "mlp.out"] = (f"{blk}.layer_scale2", OUT, same)
    if kind == "vit" or kind.startswith("dinov2"):  # CLIP's post_layernorm norms the pooled token only
        paths |= _normalized(model, "ln_final", prefix + final)
    return paths | {"ln_final": (prefix + final, OUT, same)}


# --- mixture of experts -----------------------------------------------------------------------


def _dense_routing(output: tuple) -> Tensor:
    logits, weights, index = output[:3]
    return torch.zeros(logits.shape, dtype=weights.dtype).scatter(-1, index, weights)


def moe_paths(model: nn.Module) -> dict[str, Path]:
    """Mixtral, Qwen2-MoE (+ shared expert), Qwen3-MoE, OLMoE: every point but the per-expert
    ones (test_families_moe reads those from the model's own F.linear calls)."""
    cfg = model.config
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    paths: dict[str, Path] = {"embed": ("model.embed_tokens", OUT, same)}
    for L in range(cfg.num_hidden_layers):
        p, blk = f"blocks.{L}.", f"model.layers.{L}"
        paths[p + "resid_pre"] = (f"{blk}.input_layernorm", IN, same)
        paths |= _norm(model, p, "ln1", f"{blk}.input_layernorm")
        paths |= _norm(model, p, "ln2", f"{blk}.post_attention_layernorm")
        paths |= _attention(p, f"{blk}.self_attn", "o_proj", H, KV)
        paths |= {
            p + "resid_mid": (f"{blk}.post_attention_layernorm", IN, same),
            p + "mlp.router.logits": (f"{blk}.mlp.gate", OUT, item(0)),
            p + "mlp.router.weights": (f"{blk}.mlp.gate", OUT, item(1)),
            p + "mlp.router.indices": (f"{blk}.mlp.gate", OUT, item(2)),
            p + "mlp.router.routing": (f"{blk}.mlp.gate", OUT, _dense_routing),
            p + "mlp.experts.out": (f"{blk}.mlp.experts", OUT, same),
            p + "mlp.out": (f"{blk}.mlp", OUT, same),
            p + "resid_post": (blk, OUT, same),
        }
        if getattr(cfg, "shared_expert_intermediate_size", 0):
            shared = f"{blk}.mlp.shared_expert"
            paths |= {
                p + "mlp.shared.pre": (f"{shared}.gate_proj", OUT, same),
                p + "mlp.shared.pre_linear": (f"{shared}.up_proj", OUT, same),
                p + "mlp.shared.post": (f"{shared}.down_proj", IN, same),
                p + "mlp.shared.out": (shared, OUT, same),
                p + "mlp.shared.gate": (f"{blk}.mlp.shared_expert_gate", OUT, same),
            }
    return (
        paths
        | _normalized(model, "ln_final", "model.norm")
        | {"ln_final": ("model.norm", OUT, same), "logits": ("lm_head", OUT, same)}
    )


# --- state-space and recurrent models ---------------------------------------------------------


def ssm_paths(model: nn.Module) -> dict[str, Path]:
    """Mamba (backbone.layers: norm, mixer) and RWKV (rwkv.blocks: ln1, attention, ln2,
    feed_forward; blocks and mixers return tuples)."""
    cfg = model.config
    paths: dict[str, Path] = {}
    for L in range(cfg.num_hidden_layers):
        p = f"blocks.{L}."
        if cfg.model_type == "rwkv":
            blk = f"rwkv.blocks.{L}"
            paths |= {
                p + "resid_pre": (blk, IN, same),
                p + "mixer.in": (f"{blk}.ln1", OUT, same),
                p + "mixer.out": (f"{blk}.attention", OUT, item(0)),
                p + "resid_mid": (f"{blk}.ln2", IN, same),
                p + "mlp.in": (f"{blk}.ln2", OUT, same),
                p + "mlp.out": (f"{blk}.feed_forward", OUT, item(0)),
                p + "resid_post": (blk, OUT, item(0)),
            }
        else:
            blk = f"backbone.layers.{L}"
            paths |= {
                p + "resid_pre": (f"{blk}.norm", IN, same),
                p + "mixer.in": (f"{blk}.norm", OUT, same),
                p + "mixer.in_proj": (f"{blk}.mixer.in_proj", OUT, same),
                p + "mixer.ssm_out": (f"{blk}.mixer.out_proj", IN, same),
                p + "mixer.out": (f"{blk}.mixer.out_proj", OUT, same),
                p + "resid_post": (blk, OUT, same),
            }
    rwkv = cfg.model_type == "rwkv"
    base, final, head = ("rwkv", "ln_out", "head") if rwkv else ("backbone", "norm_f", "lm_head")
    return (
        paths
        | _normalized(model, "ln_final", f"{base}.{final}")
        | {
            "embed": (f"{base}.embeddings", OUT, same),
            "ln_final": (f"{base}.{final}", OUT, same),
            "logits": (head, OUT, same),
        }
    )


def reference(model: nn.Module, paths: dict[str, Path], inputs: dict, names=None) -> dict[str, Tensor]:
    """One forward pass with plain torch hooks (helpers.plain_hooks) on the hand-written paths
    (`names`: a subset)."""
    taps = {
        name: (model.get_submodule(path), side, read)
        for name, (path, side, read) in paths.items()
        if names is None or name in names
    }
    return plain_hooks(model, taps, lambda: model(**inputs))
