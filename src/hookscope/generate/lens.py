"""A TransformerLens 3 `HookedTransformer`: it generates as a bridge does (no cache returned, its
own stop rule), but its generate embeds the tokens outside `forward` and calls `forward` directly,
takes no attention mask (it reads a batch's padding off leading pad tokens) and keeps its KV cache
in its own `past_kv_cache` (never an empty transformers cache to check)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..arch import PointSpec
from ..errors import HookscopeError, SelectionError
from .bridge import Bridge

# modules a HookedTransformer runs inside each forward pass of its generate
_IN_FORWARD = ("blocks.", "ln_final", "unembed")


class Lens(Bridge):
    cache_keys = ()

    def prompt(self, input_ids: Tensor, attention_mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
        input_ids, attention_mask = super().prompt(input_ids, attention_mask)
        if attention_mask is None:
            return input_ids, None
        # on token input, prepend_bos only tells TL whether a leading pad id is a BOS to keep
        self.options.setdefault("prepend_bos", False)
        return self._padded(input_ids, attention_mask, bool(self.options["prepend_bos"])), attention_mask

    def _padded(self, input_ids: Tensor, attention_mask: Tensor, prepend_bos: bool) -> Tensor:
        """The batch with pad ids where the mask is 0, checked to be the padding generate will see."""
        tokenizer = getattr(self.model, "tokenizer", None)
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            raise HookscopeError(
                "a padded batch through HookedTransformer.generate needs the model's "
                "tokenizer (generate reads the padding off its pad token): "
                "model.set_tokenizer(tokenizer), or give rows of equal length / generate "
                "them one by one"
            )
        try:  # TransformerLens 3.9 deprecates `transformer_lens.utils` (a DeprecationWarning) for `utilities`
            from transformer_lens.utilities import get_attention_mask
        except ImportError:  # older 3.x releases have only `utils`
            from transformer_lens.utils import get_attention_mask

        ids = input_ids.masked_fill(attention_mask == 0, pad)
        derived = get_attention_mask(tokenizer, ids, prepend_bos, padding_side="left")
        if not torch.equal(derived.to(attention_mask.device).bool(), attention_mask.bool()):
            raise HookscopeError(
                "HookedTransformer.generate would not see this padding: it treats only "
                f"leading pad tokens (id {pad}) as padding, so a left-padded batch whose "
                "first real token is the pad id (or whose mask has holes) cannot be "
                "generated faithfully; generate such rows one by one"
            )
        return ids

    def check_point(self, spec: PointSpec) -> None:
        if not spec.module.startswith(_IN_FORWARD):
            raise SelectionError(
                f"{spec.name}: TransformerLens generate embeds tokens outside its forward "
                "passes, so this point cannot follow the steps; capture blocks.* / ln_final "
                "points (or run hs.collect over gen.sequences)"
            )

    def generate_kwargs(self, extra: dict, attention_mask: Tensor | None, points: list[str]) -> dict:
        kwargs = super().generate_kwargs(extra, None, points)
        if attention_mask is not None:
            kwargs["padding_side"] = "left"  # the padding is read off the pad tokens of `prompt`
        return kwargs

    def hooked_modules(self) -> tuple[nn.Module, nn.Module]:
        return self.model.blocks[0], self.model.unembed  # generate calls forward, not the model

    def own_eos(self) -> Any:
        return None  # a HookedTransformer stops at its tokenizer's EOS
