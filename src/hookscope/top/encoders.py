"""What a unit is: a raw unit of a point (a neuron), or a feature of a sparse autoencoder (SAE).

An encoder turns a batch of a point's rows `[n, d_in]` (float32) into unit values `[n, units]`.
Supported SAEs (read from the files, no SAELens import needed):

- an SAELens directory (`cfg.json` + `sae_weights.safetensors`, as `SAE.save_model` writes it) with
  `architecture` "standard" (ReLU), "jumprelu" (ReLU, then zero where the pre-activation is not
  above `threshold`) or "topk" (keep the `k` largest pre-activations of each row, then ReLU; with
  `rescale_acts_by_decoder_norm`, pre-activations are first multiplied by the rows' decoder norms).
  `apply_b_dec_to_input` subtracts `b_dec` first. `normalize_activations` must be "none": the
  other modes need a scale that SAELens does not save beside the weights (or change the input per
  row in ways we do not reproduce), so they are refused rather than silently encoded wrong.
- a plain `.safetensors` file with `W_enc` `[d_in, d_sae]` and `b_enc` `[d_sae]` (SAELens'
  orientation), or `weight` `[d_sae, d_in]` and `bias` (an `nn.Linear`'s), optional `b_dec`
  (subtracted from the input) and `threshold` (JumpReLU); ReLU otherwise.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..errors import SAEError

SAELENS_CFG = "cfg.json"
SAELENS_WEIGHTS = "sae_weights.safetensors"
SUPPORTED_ARCHITECTURES = ("standard", "jumprelu", "topk")


@dataclass
class Encoder:
    """Unit values of a batch of rows. `kind` is "neurons" (identity) or "sae"."""

    kind: str
    d_in: int
    units: int
    source: dict[str, Any] = field(default_factory=dict)  # recorded in the index: what made the values
    W_enc: torch.Tensor | None = None  # [d_in, units]
    b_enc: torch.Tensor | None = None
    b_dec: torch.Tensor | None = None
    threshold: torch.Tensor | None = None
    topk: int | None = None
    scale: torch.Tensor | None = None  # per-unit multiplier of the pre-activations (topk rescale)

    @property
    def identity(self) -> str:
        """A short name that changes with the SAE's bytes: part of the index file name."""
        if self.kind == "neurons":
            return "neurons"
        return "sae-" + self.source["sha256"][:12]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "neurons":
            return x
        return self.encode_units(x, None)

    def encode_units(self, x: torch.Tensor, units: torch.Tensor | None) -> torch.Tensor:
        """Values of `units` (default all) for rows `x` `[n, d_in]`; per-unit for ReLU / JumpReLU,
        through the full encoding for TopK (whether a feature survives depends on the others)."""
        if self.kind == "neurons":
            return x if units is None else x[:, units]
        if self.b_dec is not None:
            x = x - self.b_dec
        full = units is None or self.topk is not None
        W = self.W_enc if full else self.W_enc[:, units]
        pre = x @ W + (self.b_enc if full else self.b_enc[units])
        if self.scale is not None:
            pre = pre * (self.scale if full else self.scale[units])
        if self.topk is not None:
            vals, idx = torch.topk(pre, min(self.topk, pre.shape[1]), dim=1)
            out = torch.zeros_like(pre).scatter_(1, idx, vals.relu())
            return out if units is None else out[:, units]
        out = pre.relu()
        if self.threshold is not None:
            th = self.threshold if full else self.threshold[units]
            out = out * (pre > th)
        return out


def neurons(d_in: int) -> Encoder:
    return Encoder("neurons", d_in, d_in, {"kind": "neurons"})


def load_encoder(path: str | Path) -> Encoder:
    """An SAELens SAE directory or a plain encoder `.safetensors` file (see the module docstring)."""
    path = Path(path)
    if path.is_dir():
        return _saelens(path)
    if path.is_file():
        return _plain(path)
    raise SAEError(
        f"{path}: no such SAE directory or encoder file; give an SAELens directory "
        f"({SAELENS_CFG} + {SAELENS_WEIGHTS}) or a .safetensors file with W_enc and b_enc"
    )


def _sha256(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return {k: v.float() for k, v in load_file(path).items()}
    except (SafetensorError, OSError, RuntimeError) as e:
        raise SAEError(f"{path}: cannot read it as safetensors ({e})") from e


def _saelens(directory: Path) -> Encoder:
    cfg_path, weights_path = directory / SAELENS_CFG, directory / SAELENS_WEIGHTS
    if not cfg_path.is_file() or not weights_path.is_file():
        raise SAEError(
            f"{directory}: an SAELens SAE directory holds {SAELENS_CFG} and {SAELENS_WEIGHTS} "
            "(as SAE.save_model writes them); one is missing"
        )
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SAEError(f"{cfg_path}: not readable JSON ({e})") from e
    arch = cfg.get("architecture", "standard")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise SAEError(
            f"{directory}: SAE architecture {arch!r} is not supported; hookscope top reads "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (fold a gated SAE into a JumpReLU one, or "
            "export plain W_enc/b_enc)"
        )
    norm = cfg.get("normalize_activations", "none")
    if norm not in (None, "none"):
        raise SAEError(
            f"{directory}: normalize_activations={norm!r} is not supported (only 'none'): the "
            "scale it needs is not saved with the weights; fold it into W_enc and b_enc"
        )
    w = _load_tensors(weights_path)
    missing = [k for k in ("W_enc", "b_enc", "b_dec") if k not in w]
    if arch == "jumprelu" and "threshold" not in w:
        missing.append("threshold")
    if missing:
        raise SAEError(f"{weights_path}: missing tensor(s) {missing} for a {arch!r} SAE")
    enc = _checked(
        weights_path,
        w["W_enc"],
        w["b_enc"],
        w["b_dec"] if cfg.get("apply_b_dec_to_input", True) else None,
        w.get("threshold") if arch == "jumprelu" else None,
    )
    if arch == "topk":
        k = cfg.get("k")
        if not isinstance(k, int) or k < 1:
            raise SAEError(f"{cfg_path}: a topk SAE needs an integer 'k' >= 1, got {k!r}")
        enc.topk = k
        if cfg.get("rescale_acts_by_decoder_norm"):
            if "W_dec" not in w:
                raise SAEError(f"{weights_path}: rescale_acts_by_decoder_norm needs W_dec")
            enc.scale = w["W_dec"].norm(dim=-1)
    enc.source = {
        "kind": "sae",
        "format": "saelens",
        "path": str(directory),
        "architecture": arch,
        "sha256": _sha256(cfg_path, weights_path),
    }
    return enc


def _plain(path: Path) -> Encoder:
    w = _load_tensors(path)
    if "W_enc" in w and "b_enc" in w:
        W, b = w["W_enc"], w["b_enc"]
    elif "weight" in w and "bias" in w:
        W, b = w["weight"].T.contiguous(), w["bias"]
    else:
        raise SAEError(
            f"{path}: an encoder file holds W_enc [d_in, d_sae] + b_enc [d_sae], or weight "
            f"[d_sae, d_in] + bias (nn.Linear); it has {sorted(w)}"
        )
    enc = _checked(path, W, b, w.get("b_dec"), w.get("threshold"))
    enc.source = {
        "kind": "sae",
        "format": "plain",
        "path": str(path),
        "architecture": "jumprelu" if enc.threshold is not None else "standard",
        "sha256": _sha256(path),
    }
    return enc


def _checked(
    where: Path, W: torch.Tensor, b: torch.Tensor, b_dec: torch.Tensor | None, threshold: torch.Tensor | None
) -> Encoder:
    if W.dim() != 2 or b.shape != (W.shape[1],):
        raise SAEError(
            f"{where}: encoder weight {tuple(W.shape)} and bias {tuple(b.shape)} do not fit "
            "([d_in, d_sae] and [d_sae])"
        )
    d_in, units = W.shape
    if b_dec is not None and b_dec.shape != (d_in,):
        raise SAEError(f"{where}: b_dec is {tuple(b_dec.shape)}, expected ({d_in},)")
    if threshold is not None and threshold.shape != (units,):
        raise SAEError(f"{where}: threshold is {tuple(threshold.shape)}, expected ({units},)")
    return Encoder("sae", d_in, units, W_enc=W.contiguous(), b_enc=b, b_dec=b_dec, threshold=threshold)
