"""A Hugging Face causal LM: its `generate` calls the model once per step, takes an attention
mask, and returns the KV cache, on which one more step runs the last sampled token."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..model_inputs import forward_parameters
from .backend import Backend
from .result import eos_list


class HuggingFace(Backend):
    def generate_kwargs(self, extra: dict, attention_mask: Tensor | None, points: list[str]) -> dict:
        kwargs = {**extra, **self.options}
        if points:
            kwargs["return_dict_in_generate"] = True  # its cache runs the last token (see `complete`)
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if "logits" in points and "logits_to_keep" in forward_parameters(type(self.model)):
            # generate computes the prompt's logits at its last position only; logits are asked for here
            kwargs.setdefault("logits_to_keep", 0)
        return kwargs

    def eos_ids(self) -> list[int]:
        eos = self.options.get("eos_token_id")
        if eos is None:
            config = self.options.get("generation_config") or getattr(self.model, "generation_config", None)
            eos = getattr(config, "eos_token_id", None)
        return eos_list(eos)

    def complete(self, output: Any, sequences: Tensor, attention_mask: Tensor | None, extra: dict) -> None:
        """One more cached step on the last sampled token, with the position id and attention mask
        `generate` would have given it; without a cache, the whole sequence once more."""
        batch, total = sequences.shape
        full_mask = torch.ones(batch, total, dtype=torch.long, device=sequences.device)
        if attention_mask is not None:
            full_mask[:, : attention_mask.shape[1]] = attention_mask
        accepted = forward_parameters(type(self.model))
        # transformers >= 5.24 names the cache `cache` (on the output and the forward; the old name is
        # deprecated) and generate passes it so; older releases call it `past_key_values` in both places
        cache_name = "cache" if "cache" in accepted else "past_key_values"
        cache = getattr(output, "cache", None)
        if cache is None:
            cache = getattr(output, "past_key_values", None)
        call: dict[str, Any] = {"attention_mask": full_mask}
        if cache is not None:
            call.update(input_ids=sequences[:, -1:], use_cache=True)
            call[cache_name] = cache
            if "position_ids" in accepted:
                # as generate counts them: real tokens before this one (left padding does not count)
                call["position_ids"] = (full_mask.cumsum(-1)[:, -1:] - 1).clamp(min=0)
        else:
            call["input_ids"] = sequences
            if "use_cache" in accepted:
                call["use_cache"] = False
            if "position_ids" in accepted and attention_mask is not None:
                call["position_ids"] = (full_mask.cumsum(-1) - 1).masked_fill(full_mask == 0, 0)
        call.update({k: v for k, v in extra.items() if k in accepted})
        with torch.inference_mode():
            self.model(**call)
