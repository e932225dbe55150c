"""Edits on a mixture-of-experts router: switch experts off, or force a routing.

Both edit `blocks.{L}.mlp.router.routing`, the router's top-k choice as one dense tensor
[tokens, n_experts] (weight of each expert per token, 0 where not routed); the model then runs
with the edited top-k indices and weights. They follow the `Edit` contract (a callable
`(act, hook) -> Tensor` with `.point`), so they go into `hs.edit` beside ablate / patch / steer:

    with hs.edit(model, ablate_expert(0, 3), force_route(1, [0, 2], tokens=[5])):
        logits = model(ids)

`tokens` picks rows of the flattened batch (row = b * seq_len + p), as router points use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .edit import Edit
from .errors import SelectionError
from .hooks import Hook

Tokens = int | Sequence[int] | Tensor | None


def _rows(act: Tensor, tokens: Tokens) -> Tensor:
    """A [tokens, 1] bool mask of the rows an edit touches."""
    keep = torch.zeros(act.shape[0], dtype=torch.bool, device=act.device)
    if tokens is None:
        keep[:] = True
    else:
        index = torch.as_tensor(tokens, device=act.device).reshape(-1)
        if index.dtype == torch.bool:
            if len(index) != act.shape[0]:
                raise SelectionError(
                    f"a bool tokens mask must have the router's {act.shape[0]} rows "
                    f"(batch * positions), got {len(index)}"
                )
            keep = index
        elif len(index) and (index.min() < -act.shape[0] or index.max() >= act.shape[0]):
            raise SelectionError(
                f"tokens {tokens!r}: the router saw {act.shape[0]} tokens (batch * positions)"
            )
        else:
            keep[index] = True
    return keep[:, None]


def _experts(act: Tensor, experts: Sequence[int]) -> list[int]:
    experts = [int(e) for e in experts]
    bad = [e for e in experts if not 0 <= e < act.shape[-1]]
    if bad:
        raise SelectionError(f"experts {bad}: this router has experts 0..{act.shape[-1] - 1}")
    return experts


@dataclass(frozen=True)
class AblateExperts(Edit):
    """Route no token to these experts: their top-k weight becomes 0 (the other experts keep
    theirs, not renormalised), which is exactly the layer with the experts' outputs zeroed."""

    experts: tuple[int, ...] = ()
    tokens: Tokens = None

    def __call__(self, act: Tensor, hook: Hook) -> Tensor:
        column = torch.zeros(act.shape[-1], dtype=torch.bool, device=act.device)
        column[_experts(act, self.experts)] = True
        return torch.where(_rows(act, self.tokens) & column, torch.zeros_like(act), act)


@dataclass(frozen=True)
class ForceRoute(Edit):
    """Send the chosen tokens to these experts with these weights (default: equal, summing to 1)."""

    experts: tuple[int, ...] = ()
    weights: tuple[float, ...] | None = None
    tokens: Tokens = None

    def __call__(self, act: Tensor, hook: Hook) -> Tensor:
        experts = _experts(act, self.experts)
        weights = self.weights or (1.0 / len(experts),) * len(experts)
        if len(weights) != len(experts):
            raise SelectionError(f"force_route: {len(experts)} experts but {len(weights)} weights")
        forced = torch.zeros_like(act)
        forced[:, experts] = torch.tensor(weights, dtype=act.dtype, device=act.device)
        return torch.where(_rows(act, self.tokens), forced, act)


def ablate_expert(layer: int, experts: int | Sequence[int], *, tokens: Tokens = None) -> Edit:
    """Switch experts of one MoE layer off (for all tokens, or the chosen rows).

    Returns:
        Edit: an edit of `blocks.{layer}.mlp.router.routing`, for `hs.edit` (zeroes those
            experts' top-k weights: the same as zeroing their outputs).

    Raises:
        SelectionError: an expert the router does not have, or tokens that do not fit (when it runs)."""
    experts = (experts,) if isinstance(experts, int) else tuple(experts)
    return AblateExperts(f"blocks.{layer}.mlp.router.routing", experts=experts, tokens=tokens)


def force_route(
    layer: int, experts: Sequence[int], weights: Sequence[float] | None = None, *, tokens: Tokens = None
) -> Edit:
    """Route tokens of one MoE layer to the given experts (at most the model's top-k of them).

    Returns:
        Edit: an edit of `blocks.{layer}.mlp.router.routing`, for `hs.edit` (equal weights
            unless given).

    Raises:
        SelectionError: no expert, as many weights as experts not given, an expert the router
            does not have (when it runs)."""
    if not experts:
        raise SelectionError("force_route needs at least one expert")
    return ForceRoute(
        f"blocks.{layer}.mlp.router.routing",
        experts=tuple(experts),
        weights=None if weights is None else tuple(float(w) for w in weights),
        tokens=tokens,
    )
