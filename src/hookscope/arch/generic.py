"""Any nn.Module: raw `module:<path>` points, plus resid_pre / resid_post of the blocks when the
model has an obvious stack of repeated blocks (its longest ModuleList of one class)."""

from __future__ import annotations

from torch import nn

from .base import Arch, PointSpec


def find_blocks(model: nn.Module) -> list[str]:
    best: list[str] = []
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            kinds = {type(m) for m in module}
            if len(kinds) == 1:
                best = [f"{path}.{i}" if path else str(i) for i in range(len(module))]
    return best


def table(model: nn.Module) -> Arch:
    blocks = find_blocks(model)
    specs: dict[str, PointSpec] = {}
    for layer, path in enumerate(blocks):
        for suffix, io in (("resid_pre", "input"), ("resid_post", "output")):
            name = f"blocks.{layer}.{suffix}"
            specs[name] = PointSpec(name=name, module=path, io=io, layer=layer)
    return Arch("generic", specs, blocks)
