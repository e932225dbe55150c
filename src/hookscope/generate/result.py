"""What `hs.generate` returns, and which of its positions hold real tokens."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class Generation(Mapping[str, Tensor]):
    """What `hs.generate` returns. Reads like a dict of activations, one per point, and resolves
    names as `hs.collect`'s result does (`activations` is the same `PointDict`): any spelling of a
    captured point reads it, a TransformerLens 4 bridge's own aliases included."""

    sequences: Tensor  # [batch, T] token ids: prompt (as given, left padding included) + new tokens
    mask: Tensor  # [batch, T] bool: True where sequences holds a real token (not padding, not after EOS)
    prompt_length: int  # P: columns [0, P) are the prompt, [P, T) were generated
    activations: dict[str, Tensor] = field(default_factory=dict)
    output: Any = None  # what the model's own generate returned (scores, etc., when asked for)

    @property
    def new_tokens(self) -> Tensor:
        return self.sequences[:, self.prompt_length :]

    def text(self, tokenizer: Any, *, prompt: bool = False) -> list[str]:
        """Each row's generated text (with `prompt=True`, the prompt too), real tokens only."""
        start = 0 if prompt else self.prompt_length
        return [
            tokenizer.decode(row[keep[start:]].tolist(), skip_special_tokens=True)
            for row, keep in zip(self.sequences[:, start:], self.mask, strict=True)
        ]

    def __getitem__(self, name: str) -> Tensor:
        try:
            return self.activations[name]
        except KeyError:
            raise KeyError(f"{name!r} was not captured; captured: {list(self.activations)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self.activations

    def __iter__(self) -> Iterator[str]:
        return iter(self.activations)

    def __len__(self) -> int:
        return len(self.activations)


def real_tokens(
    sequences: Tensor, attention_mask: Tensor | None, prompt_length: int, eos: list[int]
) -> Tensor:
    """True for prompt tokens the attention mask keeps and for generated tokens up to and
    including the row's first EOS."""
    batch, total = sequences.shape
    mask = torch.ones(batch, total, dtype=torch.bool, device=sequences.device)
    if attention_mask is not None:
        mask[:, :prompt_length] = attention_mask.to(device=sequences.device, dtype=torch.bool)
    if eos and total > prompt_length:
        new = sequences[:, prompt_length:]
        is_eos = torch.isin(new, torch.tensor(eos, device=new.device))
        # positions strictly after the first EOS: an EOS occurred at an earlier generated column
        after = (is_eos.long().cumsum(1) - is_eos.long()) > 0
        mask[:, prompt_length:] = ~after
    return mask


def eos_list(eos: Any) -> list[int]:
    """EOS ids as a list, from an int, a list or a tensor (None: no EOS)."""
    if eos is None:
        return []
    if isinstance(eos, Tensor):
        return [int(v) for v in eos.flatten().tolist()]
    return [int(eos)] if isinstance(eos, int) else [int(v) for v in eos]
