"""A TransformerLens 4 `TransformerBridge`: its generate calls the bridge once per step, like a
Hugging Face model's, and takes an attention mask; it returns no cache, so the last sampled token
is filed by one more pass over the whole sequence. Its KV cache arrives as transformers' own."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .backend import Backend
from .result import eos_list


class Bridge(Backend):
    def prompt(self, input_ids: Tensor, attention_mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # what TransformerLens assumes anyway: its unpadded path, unchanged
        return input_ids, attention_mask

    def generate_kwargs(self, extra: dict, attention_mask: Tensor | None, points: list[str]) -> dict:
        kwargs = {**extra, **self.options}
        kwargs.pop("return_dict_in_generate", None)
        kwargs.setdefault("verbose", False)
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        return kwargs

    def eos_ids(self) -> list[int]:
        if not self.options.get("stop_at_eos", True):
            return []
        eos = self.options.get("eos_token_id")
        if eos is None:
            eos = self.own_eos()
        if eos is None:
            eos = getattr(getattr(self.model, "tokenizer", None), "eos_token_id", None)
        return eos_list(eos)

    def own_eos(self) -> Any:
        """The stop tokens the model names itself: a bridge's adapter may (chat turn ends)."""
        return getattr(self.model.cfg, "eos_token_id", None)

    def complete(self, output: Any, sequences: Tensor, attention_mask: Tensor | None, extra: dict) -> None:
        """A pass over the whole final sequence, with the prompt's padding masked."""
        call: dict[str, Any] = {}
        if attention_mask is not None:
            full = torch.ones_like(sequences)
            full[:, : attention_mask.shape[1]] = attention_mask.to(sequences.device)
            call["attention_mask"] = full
        with torch.inference_mode():
            self.model(sequences, **call)
