"""What a model is called with: run it on any input shape, find its attention mask, know how long
an input it takes. Imports nothing of ours: capture, profiling and extraction all call models."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn


def call_model(model: nn.Module, inputs: Any, **options: Any) -> Any:
    """Run `model` on a tensor (input ids), a mapping (keyword inputs) or a tuple (positional);
    `options` are extra keyword arguments, which a mapping's own keys override."""
    if isinstance(inputs, Mapping):
        return model(**{**options, **inputs})
    if isinstance(inputs, tuple):
        return model(*inputs, **options)
    return model(inputs, **options)


@functools.cache
def forward_parameters(cls: type) -> frozenset[str]:
    """The keyword arguments a model class's `forward` takes (`use_cache`, `position_ids`, ...)."""
    return frozenset(inspect.signature(cls.forward).parameters)


def attention_mask_of(kwargs: Mapping[str, Any]) -> Tensor | None:
    """The attention mask among a model call's keyword arguments (Hugging Face and
    TransformerLens both call it `attention_mask`), or None."""
    mask = kwargs.get("attention_mask")
    return mask if isinstance(mask, Tensor) and mask.ndim == 2 else None


_POSITION_TABLES = ("wpe", "position_embeddings", "embed_positions")  # GPT-2, BERT, OPT-like


def max_positions(model: nn.Module) -> int | None:
    """The longest input a model with a learned position-embedding table takes; None for rotary or
    relative positions, which have no hard limit."""
    if not any(name.rsplit(".", 1)[-1] in _POSITION_TABLES and isinstance(m, nn.Embedding)
               for name, m in model.named_modules()):
        return None
    config = getattr(model, "config", None)
    for key in ("n_positions", "max_position_embeddings"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None
