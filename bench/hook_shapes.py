"""The hook callables of benchmark a: the same no-op in four shapes.

A hook holding a dict of 200 tensors is what a user's caching or patching hook looks like; its
`repr()` walks all 200 tensors, so any library that names a hook with `repr()` when attaching it
pays for that on every attach. Every shape takes `*args, **kwargs` so one object can be handed to
torch (`module, args, output`), hookscope (`act, hook`) and TransformerLens (`act, hook=`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

SHAPES = ("function", "partial", "dataclass", "method")
N_TENSORS, TENSOR_SHAPE = 200, (64, 768)


def noop(*args, **kwargs) -> None:
    return None


def noop_with_state(tensors: dict, *args, **kwargs) -> None:
    return None


@dataclass
class TensorStore:
    """A callable holding tensors; the dataclass-generated repr prints every one of them."""

    tensors: dict

    def __call__(self, *args, **kwargs) -> None:
        return None

    def hook(self, *args, **kwargs) -> None:
        return None


def make_hook(shape: str):
    """A no-op hook of the given shape (see SHAPES)."""
    if shape == "function":
        return noop
    generator = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(TENSOR_SHAPE, generator=generator) for i in range(N_TENSORS)}
    if shape == "partial":
        return functools.partial(noop_with_state, tensors)
    if shape == "dataclass":
        return TensorStore(tensors)
    if shape == "method":
        return TensorStore(tensors).hook
    raise ValueError(f"unknown hook shape {shape!r}; one of {SHAPES}")
