"""A model whose weights come and go: built on the `meta` device, each tensor read on demand from
its safetensors checkpoint (safetensors' per-tensor reads) and placed with accelerate's
`set_module_tensor_to_device`; sent back to `meta` when no longer needed.

    model = empty_model(config, AutoModelForCausalLM)  # every parameter on meta, buffers real
    ckpt = Checkpoint(source)
    place(model, ckpt.read(names_under(model, "model.layers.3")))   # one block's weights
    release(model, "model.layers.3")              # back to meta: its memory is freed

Buffers computed at init (rotary `inv_freq`, position ids) stay real: the model is built under
accelerate's `init_empty_weights()`, which puts only parameters on meta. This is the partial
loader block streaming needs (stream.py); `hs.load(..., points=)` can adopt it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import ModelLoadError

_INDEX = "model.safetensors.index.json"


class Checkpoint:
    """The tensors of a saved model directory (one `model.safetensors`, or shards listed in
    `model.safetensors.index.json`), read one at a time. A model parameter's name is looked up as
    it is, then without / with the model's base prefix (a base model read from a checkpoint saved
    with a head, and the reverse)."""

    def __init__(self, directory: str | Path, base_prefix: str = ""):
        self.directory = Path(directory)
        index = self.directory / _INDEX
        if index.is_file():
            self.file_of: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.directory / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(self.directory / "model.safetensors", framework="pt") as f:
                self.file_of = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise ModelLoadError(f"{self.directory} has no model.safetensors (nor {_INDEX}): streaming "
                                 "reads weights tensor by tensor from safetensors; re-save the model with "
                                 "save_pretrained(safe_serialization=True)")
        self.base_prefix = base_prefix + "." if base_prefix else ""
        self._handles: dict[str, Any] = {}

    def key(self, name: str) -> str | None:
        """The checkpoint's key for model tensor `name`, or None when it holds none."""
        candidates = [name]
        if self.base_prefix and name.startswith(self.base_prefix):
            candidates.append(name[len(self.base_prefix):])
        elif self.base_prefix:
            candidates.append(self.base_prefix + name)
        return next((c for c in candidates if c in self.file_of), None)

    def read(self, names: list[str], dtypes: dict[str, torch.dtype] | None = None,
             device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """{name: tensor} read from disk, cast to `dtypes[name]` (floating tensors only) and moved
        to `device`; safe to call from a read-ahead thread."""
        out = {}
        for name in names:
            key = self.key(name)
            if key is None:
                raise ModelLoadError(f"{self.directory} holds no tensor for {name!r}: its tensor names do "
                                     "not match this model's (a layout transformers converts while loading, "
                                     "such as fused experts?); run without streaming")
            tensor = self._handle(self.file_of[key]).get_tensor(key)
            if dtypes and name in dtypes and tensor.is_floating_point():
                tensor = tensor.to(dtypes[name])
            out[name] = tensor.to(device)
        return out

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            from safetensors import safe_open

            self._handles[file] = safe_open(self.directory / file, framework="pt")
        return self._handles[file]


def empty_model(config: Any, auto: Any, dtype: torch.dtype | None = None) -> nn.Module:
    """`auto.from_config(config)` with every parameter on meta (no memory), in eval mode."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = auto.from_config(config, dtype=dtype or getattr(config, "dtype", None) or torch.float32)
    return model.eval()


def names_under(model: nn.Module, prefix: str) -> list[str]:
    """The parameter names of the module at `prefix` ("" is the whole model), in full."""
    module = model.get_submodule(prefix) if prefix else model
    dot = prefix + "." if prefix else ""
    return [dot + name for name, _ in module.named_parameters()]


def place(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Put read tensors into the model (each replaces a meta parameter of the same shape)."""
    from accelerate.utils import set_module_tensor_to_device

    for name, value in tensors.items():
        set_module_tensor_to_device(model, name, value.device, value=value)


def release(model: nn.Module, prefix: str) -> None:
    """Send every parameter of the module at `prefix` back to meta, freeing its memory."""
    from accelerate.utils import set_module_tensor_to_device

    for name in names_under(model, prefix):
        set_module_tensor_to_device(model, name, "meta")


def nbytes(model: nn.Module, names: list[str]) -> int:
    """What `names` take once materialized, meta or not (in the dtype the model holds them)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return sum(params[n].numel() * params[n].element_size() for n in names)


def resident_bytes(model: nn.Module) -> int:
    """What the model's parameters off meta take now (a tied weight counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
