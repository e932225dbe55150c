"""Which family a model belongs to, and its table of points; and the one per-model registry.

`arch_of(model)` is cached per model object: building a table is cheap, but capture calls it on
every forward pass, where microseconds count. The cache is one field of `ModelState`, the only
place hookscope keeps anything per model (the layers above add their own fields' values: the
compile layer its seam, the hooks their reference-counted holds).

This is extension API, not at the top level of `hs`: `from hookscope.arch import arch_of` gives a
model's table (an `Arch` of `PointSpec`s, both in `base.py`), for code that reads module paths,
views or block paths; a new family is one file here (docs/architecture.md, "Where a new thing goes").
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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

__all__ = [
    "Arch",
    "PointSpec",
    "View",
    "arch_of",
    "state_of",
    "ModelState",
    "FAMILIES",
    "meaning_changes",
    "meaning_changes_of_class",
]

FAMILIES = (gpt2, llama, gpt_neox, bert, moe, vit, clip, dinov2, mamba, rwkv)
_BY_MODEL_TYPE = {mt: fam for fam in FAMILIES for mt in fam.MODEL_TYPES}


@dataclass
class ModelState:
    """Everything hookscope remembers about one model object (dropped with the model)."""

    arch: Arch | None = None
    # set by a layer on top of the core (the compile layer) to change how hooks run inside its
    # compiled regions; the core only calls it (see `hooks.Layer`), never imports it
    layer: Any = None
    # reference-counted switches (`hooks.hold`): key -> [holders, undo]
    holds: dict[Any, list] = field(default_factory=dict)


# id(model) -> state, with a weak reference to check that the id still names that model (ids are
# reused after a model is freed) and a finalizer that drops the entry with the model. A plain dict
# lookup: half the cost of a WeakKeyDictionary's, which builds a weak reference per lookup, and
# every hook set and capture does one.
_STATE: dict[int, tuple[weakref.ref, ModelState]] = {}


def state_of(model: nn.Module) -> ModelState:
    """The model's registry entry, made on first use."""
    entry = _STATE.get(id(model))
    if entry is not None and entry[0]() is model:
        return entry[1]
    key, state = id(model), ModelState()
    _STATE[key] = (weakref.ref(model, lambda ref, key=key: _forget(key, ref)), state)
    return state


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _STATE.get(key)
    if entry is not None and entry[0] is ref:
        del _STATE[key]


# Functions a room on top registers to change a model's table once it is detected (the
# tensor-parallel engine: a sharded point's view gathers the ranks' slices first). Each returns a
# new table for a model it handles, else None; the core calls them and never imports their room.
TABLE_CHANGES: list[Callable[[nn.Module, Arch], Arch | None]] = []


def arch_of(model: nn.Module) -> Arch:
    state = state_of(model)
    if state.arch is None:
        arch = _detect(model)
        for change in TABLE_CHANGES:
            arch = change(model, arch) or arch
        state.arch = arch
    return state.arch


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
    lm_head = next(
        (
            h
            for h in ("lm_head", "embed_out", "head")  # "head": RWKV
            if isinstance(getattr(model, h, None), nn.Module)
        ),
        None,
    )
    return family.table(config, prefix, lm_head)


def _has_path(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
        return True
    except AttributeError:
        return False


def meaning_changes(arch: Arch) -> dict[str, tuple[str, str]]:
    """Point-name suffixes whose meaning changed in this hookscope on this model's family ->
    (what the name means now, what it meant before): the meaning a store records for them."""
    return _family_meaning_changes(arch.family)


def _family_meaning_changes(family: str) -> dict[str, tuple[str, str]]:
    if family == "tl_bridge":
        return tl_bridge.MEANING_CHANGES
    module = _BY_MODEL_TYPE.get(family)
    changes = getattr(module, "meaning_changes", None)
    return changes(family) if changes else {}


# model classes of the families in meaning_changes, for stores written before they recorded it
# (their settings name the class, not the family)
_CLASS_FAMILY = {
    "Gemma2": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3TextModel": "gemma3_text",
    "Olmo2": "olmo2",
    "Dinov2": "dinov2",
    "TransformerBridge": "tl_bridge",
}


def meaning_changes_of_class(model_class: str) -> dict[str, tuple[str, str]]:
    """`meaning_changes` for a model known only by its class name (a store's settings)."""
    family = next((f for prefix, f in _CLASS_FAMILY.items() if model_class.startswith(prefix)), "")
    return _family_meaning_changes(family)
