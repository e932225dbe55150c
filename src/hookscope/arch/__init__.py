"""Which family a model belongs to, and its table of points.

`arch_of(model)` is cached per model object: building a table is cheap, but capture calls it on
every forward pass, where microseconds count.
"""

from __future__ import annotations

import weakref

from torch import nn

from . import (
    bert,
    clip,
    dinov2,
    generic,
    gpt2,
    gpt_neox,
    llama,
    mamba,
    moe,
    rwkv,
    tl_bridge,
    transformer_lens,
    vit,
)
from .base import Arch, PointSpec, View

__all__ = ["Arch", "PointSpec", "View", "arch_of", "FAMILIES"]

FAMILIES = (gpt2, llama, gpt_neox, bert, moe, vit, clip, dinov2, mamba, rwkv)
_BY_MODEL_TYPE = {mt: fam for fam in FAMILIES for mt in fam.MODEL_TYPES}
_CACHE: weakref.WeakKeyDictionary[nn.Module, Arch] = weakref.WeakKeyDictionary()


def arch_of(model: nn.Module) -> Arch:
    arch = _CACHE.get(model)
    if arch is None:
        arch = _CACHE[model] = _detect(model)
    return arch


def _detect(model: nn.Module) -> Arch:
    if tl_bridge.is_bridge(model):  # before the HookedTransformer check: a bridge has hook_dict too
        return tl_bridge.table(model)
    if transformer_lens.is_transformer_lens(model):
        return transformer_lens.table(model)
    config = getattr(model, "config", None)
    family = _BY_MODEL_TYPE.get(getattr(config, "model_type", None))
    if family is None:
        return generic.table(model)
    # A *ForCausalLM / *LMHeadModel wraps the base model in an attribute; a base model does not.
    has_layers = _has_path(model, family.LAYERS)
    prefix = "" if has_layers else f"{family.BASE}."
    if not has_layers and not _has_path(model, prefix + family.LAYERS):
        return generic.table(model)
    lm_head = next((h for h in ("lm_head", "embed_out", "head")  # "head": RWKV
                    if isinstance(getattr(model, h, None), nn.Module)), None)
    return family.table(config, prefix, lm_head)


def _has_path(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
        return True
    except AttributeError:
        return False
