"""TransformerLens's `ln1.normalized` / `ln2.normalized` / `*.scale` on Hugging Face norms.

TransformerLens (HookedTransformer and the 4.x bridge alike) hooks a norm's input divided by its
scale, *before* the norm's weight and bias: LayerNorm `(x - mean(x)) / sqrt(var(x) + eps)`, RMSNorm
`x / sqrt(mean(x^2) + eps)`, computed in float32 for lower-precision inputs. A Hugging Face norm
computes that inside one forward, at no module boundary, so these views read the norm's call (its
input and its eps) and compute the same quantity. They are read-only: to change what a sublayer
reads, edit `attn.in` / `mlp.in` (the norm's output).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..errors import HookscopeError
from .base import Call, View

CALL = {"item": None}  # the spec reads the norm's whole call (module and input)


# norms that keep their eps in the forward's code, not in an attribute
_FIXED_EPS = {"OlmoLayerNorm": 1e-5}


def _eps(norm: nn.Module) -> float:
    if type(norm).__name__ in _FIXED_EPS:
        return _FIXED_EPS[type(norm).__name__]
    for attr in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(norm, attr, None)
        if isinstance(value, (int, float)):
            return float(value)
    raise HookscopeError(f"{type(norm).__name__} has no eps attribute: read module:<path>:input instead")


def _centred(norm: nn.Module) -> bool:
    """LayerNorm (torch's, OLMo's weightless one) subtracts the mean; RMSNorm (Llama, Gemma,
    Mixtral, ...) does not."""
    return isinstance(norm, nn.LayerNorm) or "RMS" not in type(norm).__name__


def _parts(call: Call) -> tuple[Tensor, Tensor, torch.dtype]:
    """(x, scale) in float32 or float64, as TransformerLens computes them, and the input dtype."""
    x = call.args[0] if call.args else call.kwargs.get("hidden_states", next(iter(call.kwargs.values())))
    dtype = x.dtype
    x = x if dtype in (torch.float32, torch.float64) else x.float()
    if _centred(call.module):
        x = x - x.mean(-1, keepdim=True)
    scale = (x.pow(2).mean(-1, keepdim=True) + _eps(call.module)).sqrt()
    return x, scale, dtype


def _read_only(raw: Call, new: Tensor) -> Call:
    raise HookscopeError(
        "ln1.normalized / ln2.normalized / *.scale are computed from the norm's input and cannot be "
        "written: edit attn.in / mlp.in (what the sublayer reads) or resid_pre / resid_mid instead"
    )


def _normalized(call: Call) -> Tensor:
    x, scale, dtype = _parts(call)
    return (x / scale).to(dtype)


def _scale(call: Call) -> Tensor:
    _, scale, dtype = _parts(call)
    return scale.to(dtype)


NORMALIZED = View(_normalized, _read_only, "computed: input / scale")
SCALE = View(_scale, _read_only, "computed: scale")


def entries(prefix: str, norm: str) -> dict:
    """`{prefix}.normalized` and `{prefix}.scale` of the norm module at path `norm`."""
    return {
        f"{prefix}.scale": (norm, "input", SCALE, CALL),
        f"{prefix}.normalized": (norm, "input", NORMALIZED, CALL),
    }
