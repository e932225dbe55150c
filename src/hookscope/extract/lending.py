"""A capture on the CPU whose kept rows go straight into the out stage's reused host buffers.

`hs.capture` keeps a token mask's rows in a tensor of their own. An extraction on the CPU would
then copy those rows once more into the memory its writer reads, and fault fresh pages in for
every batch. `LendingCapture` overrides the capture's one seam, `Capture.take`: each point's rows
are gathered (and cast) straight into a buffer the out stage lends (`CopyOut.lend`: memory written
batch after batch, or a stacked point's slot of its column), and the out stage knows the buffers
it lent by the tensors it handed out, so it takes them back once their bytes are written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor, nn

from ..arch import PointSpec
from ..capture import Capture
from ..selection import Selection
from ..token_rows import KeptRows, select_tokens


class Lender(Protocol):
    def lend(self, point: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """A host tensor of `shape` and `dtype` for `point`'s kept rows."""
        ...


class LendingCapture(Capture):
    """`Capture` with a token mask whose CPU rows are written into `lender`'s buffers; anything else
    (another device, heads, a compiled region's eager half) is kept as `Capture` keeps it."""

    def __init__(self, model: nn.Module, points: Sequence[str], *, lender: Lender | None, **options):
        super().__init__(model, points, **options)
        self.lender = lender
        self._rows = KeptRows()  # the mask's kept rows, found once for every point

    def take(
        self, act: Tensor, spec: PointSpec, *, selection: Selection | None = None, copy: bool = True
    ) -> Tensor:
        sel = self.selection
        on_host = act.device.type == "cpu" and (sel.device is None or sel.device.type == "cpu")
        lends = self.lender is not None and sel.token_mask is not None and sel.heads is None
        if selection is not None or not lends or not on_host:
            return super().take(act, spec, selection=selection, copy=copy)
        cast = sel.dtype if sel.dtype is not None and act.is_floating_point() else None
        n_rows = self._rows.of(sel.token_mask, act.device).numel()
        buffer = self.lender.lend(spec.name, (n_rows, *act.shape[2:]), cast or act.dtype)
        return select_tokens(act, sel.token_mask, spec.pos_dim, self._rows, cast, out=buffer)
