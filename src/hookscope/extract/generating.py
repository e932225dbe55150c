"""The generating executor (`--generate N`): the extraction loop's third executor, beside `InMemory`
(loop.py's `Executor` is the seam). Per batch it runs `hs.generate` (greedy, `source.new_tokens`
after the source's prompt, every point captured at every step) and the source turns the
`Generation` into rows; resume, signals and torchrun stay the loop's."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from ..extract_config import Run
from ..generate import generate
from ..sources import Batches, GeneratedSource, Rows
from .lending import Lender


class Generating:
    """Runs one batch at a time through the model's own `generate`, greedy, so a resumed run makes
    the same rows. The activations are kept on the CPU (a continuation's length is known only once
    it ends)."""

    def __init__(
        self, source: GeneratedSource, model: nn.Module, points: Sequence[str], dtype: torch.dtype, run: Run
    ):
        self.source, self.model, self.points, self.dtype = source, model, list(points), dtype
        self.run_on = run
        self.pad_id = _pad_id(model)

    def run(
        self, batches: Batches, *, lender: Lender | None = None, on_stage: Callable[[str], None] | None = None
    ) -> Iterator[tuple[int, dict[str, Tensor], Rows]]:
        for index, batch in batches:
            yield index, batch, self.forward(batch)

    def forward(self, batch: dict[str, Tensor]) -> Rows:
        device = self.run_on.device
        prompt = {k: v.to(device) for k, v in self.source.call_of(batch, device).inputs.items()}
        generation = generate(
            self.model,
            prompt,
            self.points,
            dtype=self.dtype,
            device="cpu",
            max_new_tokens=self.source.new_tokens,
            min_new_tokens=0,
            do_sample=False,
            pad_token_id=self.pad_id,
        )
        return self.source.generated_rows(batch, generation)


def _pad_id(model: nn.Module) -> int:
    """The token generate pads finished rows with: the model's pad token, else its (first) EOS, else 0."""
    config = getattr(model, "generation_config", None)
    pad = getattr(config, "pad_token_id", None)
    if pad is None:
        pad = getattr(config, "eos_token_id", None) or 0
    return pad[0] if isinstance(pad, (list, tuple)) else pad
