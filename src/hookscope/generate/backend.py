"""What differs between kinds of model under `hs.generate`: one small class per kind.

The driver (`driver.py`) hooks, captures and edits the same way for every model; a backend says
how this kind of model is asked to generate (`generate_kwargs`, `prompt`), which modules start and
end one of its forward passes (`hooked_modules`), which points its passes reach (`check_point`),
where its KV cache comes in (`cache_keys`), its EOS ids (`eos_ids`), and how the last sampled
token, which `generate` never feeds back, gets its activations (`complete`).

A new kind of model: copy `hf.py` (a model whose generate calls the model once per step) or
`bridge.py` (one that needs its own keywords), subclass `Backend`, and add it to `backend_for`
in `driver.py`.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ..arch import PointSpec


class Backend:
    """What every backend answers; `cache_keys`, `prompt`, `check_point` and `hooked_modules` have a
    common answer that a subclass may change."""

    cache_keys: tuple[str, ...] = ("past_key_values", "cache")  # where a step's KV cache comes in

    def __init__(self, model: nn.Module, options: dict[str, Any]):
        self.model = model
        self.options = options  # the caller's generate keywords, as given

    def prompt(self, input_ids: Tensor, attention_mask: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The ids `generate` is given, and the prompt's mask as the rest of the run reads it."""
        return input_ids, attention_mask

    def check_point(self, spec: PointSpec) -> None:
        """Refuse a point this model's generate cannot show step by step (before generating)."""

    def generate_kwargs(self, extra: dict, attention_mask: Tensor | None, points: list[str]) -> dict:
        """The keywords of `model.generate`."""
        raise NotImplementedError

    def hooked_modules(self) -> tuple[nn.Module, nn.Module]:
        """The modules whose pre-hook starts and whose forward hook ends one forward pass."""
        return self.model, self.model

    def eos_ids(self) -> list[int]:
        raise NotImplementedError

    def complete(self, output: Any, sequences: Tensor, attention_mask: Tensor | None, extra: dict) -> None:
        """Run the model so that the last sampled token's activations are filed too."""
        raise NotImplementedError
