"""What a model is called with: run it on any input shape, find its attention mask, know how long
an input it takes, call it on rows with no padding without a host wait. Imports nothing of ours:
capture, profiling and extraction all call models."""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import torch
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
    if not any(
        name.rsplit(".", 1)[-1] in _POSITION_TABLES and isinstance(m, nn.Embedding)
        for name, m in model.named_modules()
    ):
        return None
    config = getattr(model, "config", None)
    for key in ("n_positions", "max_position_embeddings"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


_UNPADDED: ContextVar[bool] = ContextVar("hookscope_unpadded", default=False)
# transformers' mask builders that read the padding mask's values on the host (`masking_utils`);
# each takes `attention_mask=None` as no padding (flex attention's, compiled, is left as it is)
_BUILDERS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flash_attention_4")
_wrapping = threading.Lock()


@contextlib.contextmanager
def unpadded(known: bool = True) -> Iterator[None]:
    """Model calls in this block (this thread only) whose attention mask is all ones, as the caller
    knows from the host (`known`: else nothing changes). Given a mask, transformers' mask builders
    check on every forward that it is all ones (a `.all()` read on the host: on a GPU the host
    waits for the device there); in this block they get none, and take the path that check leads
    to (no mask, or the same causal or sliding-window mask), so the same kernels give the same
    bits. The model is still called with its mask: given none, transformers reads the position
    ids instead, looking for packed sequences, and waits there."""
    if not known or not _wrap_mask_builders():
        yield
        return
    token = _UNPADDED.set(True)
    try:
        yield
    finally:
        _UNPADDED.reset(token)


def _wrap_mask_builders() -> bool:
    """Registers (once) each builder in `_BUILDERS` again, wrapped to drop the padding mask inside
    `unpadded`: outside it the wrapper passes every call through unchanged. False where this
    transformers has no mask builder registry."""
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:
        return False
    with _wrapping:
        for name in _BUILDERS:
            builder = ALL_MASK_ATTENTION_FUNCTIONS.get(name)
            if builder is None or getattr(builder, "hookscope_unpadded", False):
                continue

            @functools.wraps(builder)
            def wrapped(
                *args: Any, attention_mask: Any = None, _builder: Any = builder, **kwargs: Any
            ) -> Any:
                # a compiled graph reads no host value anyway (and cannot trace a context variable)
                if not torch.compiler.is_compiling() and _UNPADDED.get():
                    attention_mask = None
                return _builder(*args, attention_mask=attention_mask, **kwargs)

            wrapped.hookscope_unpadded = True  # type: ignore[attr-defined]
            AttentionMaskInterface.register(name, wrapped)
    return True
