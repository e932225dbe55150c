"""The block-streamed executor (`--max-memory`): the extraction loop's second executor, beside
`InMemory` (loop.py's `Executor` is the seam). It reads a chunk of this rank's pending batches,
runs them layer-major through `stream.BlockStreamer` (each block's weights read once per chunk),
and yields the chunk's rows in index order; the loop writes them, so the store, resume, signals
and torchrun promises are the loop's, unchanged."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from ..extract_config import ExtractConfig, Run
from ..loading import Loaded, parse_size, streamer_for
from ..model_inputs import unpadded
from ..sources import Batches, Rows, Source
from .lending import Lender


class Streamed:
    """Runs chunks of `plan.chunk_batches` batches through the blocks one at a time. `on_stage` is
    told where the run is ("block 3/32") for the progress bar."""

    def __init__(
        self,
        source: Source,
        loaded: Loaded,
        points: Sequence[str],
        dtype: torch.dtype,
        run: Run,
        cfg: ExtractConfig,
    ):
        self.source = source
        self.run_on = run
        self.on_stage: Callable[[str], None] | None = None
        self.streamer = streamer_for(
            loaded,
            list(points),
            parse_size(cfg.max_memory),
            batch_size=cfg.batch_size,
            context=source.item_tokens(),
            dtype=dtype,
            device=run.device,
            revision=cfg.revision,
            on_block=self._where,
        )

    def _where(self, block: int, blocks: int) -> None:
        if self.on_stage is not None:
            self.on_stage(f"block {block + 1}/{blocks}" if block < blocks else "after the blocks")

    def run(
        self, batches: Batches, *, lender: Lender | None = None, on_stage: Callable[[str], None] | None = None
    ) -> Iterator[tuple[int, dict[str, Tensor], Rows]]:
        self.on_stage = on_stage  # told by `_where` as the streamer reaches each block
        pending = iter(batches)
        try:
            while chunk := list(itertools.islice(pending, self.streamer.plan.chunk_batches)):
                device = self.run_on.device
                calls = [self.source.call_of(batch, device) for _, batch in chunk]  # made in the data stage
                inputs = [{k: v.to(device, non_blocking=True) for k, v in c.inputs.items()} for c in calls]
                keeps = [None if c.keep is None else c.keep.to(device) for c in calls]
                # every pass through a block builds the masks again: with no padding, nothing waits
                with unpadded(all(c.unpadded for c in calls)):
                    chunk_acts = self.streamer.run_chunk(inputs, keeps)
                for (index, batch), call, acts in zip(chunk, calls, chunk_acts, strict=True):
                    yield index, batch, self.source.rows_of(batch, call, acts)
        finally:
            self.streamer.close()
