"""One point's captured positions across generation steps, filed pass by pass.

A pass covers sequence positions [offset, offset + n). Of each, a `Kept` holds only what its
positions selection can still need: the positions the selection names counting from the start
(`Selection.at(offset).window(n)`), and the last `Selection.tail` positions seen, for those it
names counting from the end (known only once the sequence is complete). At the end, the
selection is applied with `hs.collect`'s rules (and errors) to the sequence's position numbers.

Every position kept (no positions selection, the common case) goes into one buffer of the whole
sequence's length, allocated once, each pass's positions copied into place: one copy per step,
no allocation, and no concatenation at the end. `StepCapture` is `hs.capture` filing straight into
each point's `Kept`, which follows the passes from the lengths it is given (`Kept.file`): nothing
else runs per token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..arch import PointSpec
from ..capture import Capture
from ..selection import Selection
from ..stopping import Stop
from .steps import pass_window


class _SequenceDims:
    """The dims of a [batch, position] table of sequence positions (for `Selection.select`)."""

    pos_dim, head_dim = 1, None


_SEQUENCE = _SequenceDims()


class Kept:
    """One point's kept positions: with `buffered`, one [batch, capacity, ...] buffer that each pass's
    positions are copied into (the chunks filed may be views of the model's own tensors); else
    chunks of [batch, n, ...] (copies already) with the sequence position of each column, and the tail."""

    def __init__(self, selection: Selection, *, buffered: bool = False, capacity: int = 0):
        self.selection = selection  # positions only, parsed once by Selection.of
        self.buffered = buffered and selection.positions is None
        self.capacity = capacity  # the sequence length expected (0: unknown; the buffer grows)
        self.buffer: Tensor | None = None
        self.filled = 0  # positions [0, filled) have been filed
        self.tail = selection.tail
        self.chunks: list[tuple[Tensor, list[int]]] = []
        self.tail_x: Tensor | None = None
        self.tail_pos: list[int] = []

    def file(self, chunk: Tensor) -> None:
        """File a pass's value of the point ([batch, n, ...]): the positions the pass covers follow
        from n and what was filed before (`steps.pass_window`); those computed before are skipped."""
        filled = self.filled
        lo, hi = pass_window(filled, chunk.shape[1])
        self.add(chunk if filled == lo else chunk[:, filled - lo :], filled)
        self.filled = hi

    def add(self, chunk: Tensor, start: int) -> None:
        """File the pass's `chunk` ([batch, n, ...]), which holds sequence positions from `start` on."""
        n = chunk.shape[1]
        if self.buffered:
            end = start + n
            buffer = self.buffer
            if buffer is None or end > buffer.shape[1]:
                buffer = self._grown(chunk, end)
            buffer.narrow(1, start, n).copy_(chunk)
            return
        wanted = None if self.selection.positions is None else self.selection.at(start).window(n)
        if wanted is None or bool(wanted.all()):
            self.chunks.append((chunk, list(range(start, start + n))))
        elif bool(wanted.any()):
            idx = wanted.nonzero().flatten()
            self.chunks.append((chunk.index_select(1, idx.to(chunk.device)), (idx + start).tolist()))
        if self.tail:
            x = chunk if self.tail_x is None else torch.cat([self.tail_x, chunk], dim=1)
            pos = self.tail_pos + list(range(start, start + n))
            self.tail_x, self.tail_pos = x[:, -self.tail :], pos[-self.tail :]

    def _grown(self, chunk: Tensor, end: int) -> Tensor:
        """A buffer for at least `end` positions, holding what was filed so far (grows by doubling
        where the length was not known, so a long generation copies O(length) in all)."""
        old = self.buffer  # (holding positions [0, self.filled))
        length = max(end, self.capacity, 2 * old.shape[1] if old is not None else 0)
        buffer = chunk.new_empty((chunk.shape[0], length, *chunk.shape[2:]))
        if old is not None and self.filled:
            buffer.narrow(1, 0, self.filled).copy_(old.narrow(1, 0, self.filled))
        self.buffer = buffer
        return buffer

    def result(self, total: int, batch: int) -> Tensor:
        """The selection over the whole sequence of `total` positions, as `hs.collect` shapes it."""
        if self.selection.positions is None:
            if self.buffered:
                x = self.buffer if self.buffer.shape[1] == total else self.buffer[:, :total].contiguous()
            else:
                x = torch.cat([c for c, _ in self.chunks], dim=1)
            return x.expand(batch, *x.shape[1:]) if x.shape[0] == 1 and batch > 1 else x
        columns: dict[int, tuple[Tensor, int]] = {}
        parts = list(self.chunks) + ([(self.tail_x, self.tail_pos)] if self.tail_x is not None else [])
        for c, pos in parts:
            for i, p in enumerate(pos):
                columns[p] = (c, i)
        where = self.selection.select(torch.arange(total).expand(batch, total), _SEQUENCE)
        order = sorted(columns)
        kept = torch.stack([columns[p][0].select(1, columns[p][1]) for p in order], dim=1)
        if kept.shape[0] == 1 and batch > 1:
            kept = kept.expand(batch, *kept.shape[1:])
        lookup = torch.full((total,), -1, dtype=torch.long)
        lookup[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
        idx = lookup[where].to(kept.device)
        rows = torch.arange(batch, device=kept.device)
        return kept[rows, idx] if idx.ndim == 1 else kept[rows[:, None], idx]


class StepCapture(Capture):
    """`hs.capture` (its hooks, compile seam, dtype / device / heads) whose kept values are filed at
    once into each point's `Kept`. Where every position is kept on the activation's device, a hook
    hands over the activation itself (no copy of its own) and the buffer's copy is the only one."""

    def __init__(self, model, kept: dict[str, Kept], **options):
        super().__init__(model, list(kept), stop=False, **options)
        self.by_name = {spec.name: kept[key] for key, spec in self._keys.items()}
        self.buffered = all(k.buffered for k in kept.values())  # each point's buffer copies it
        self.last_pass: Stop | None = None  # during `run_last`: what ends the pass
        self.unfiled: set[str] = set()

    def take(self, act: Tensor, spec: PointSpec, *, selection=None, copy: bool = True) -> Tensor:
        # a hook's own value goes straight to the buffer, which copies it; a compiled region's
        # eager half (`selection` given) copies as the compile layer asks
        return super().take(
            act, spec, selection=selection, copy=copy and not (self.buffered and selection is None)
        )

    def file(self, name: str, kept: Tensor) -> None:
        self.by_name[name].file(kept)
        if self.last_pass is not None:
            self.unfiled.discard(name)
            if not self.unfiled:
                self.last_pass.now()

    def run_last(self, run: Callable[[], None]) -> None:
        """`run()` the pass on the last sampled token (which generate never runs), ended once every
        point has been filed: no layer after the last captured point runs, nor the unembedding."""
        stop = self.last_pass = Stop()
        self.unfiled = set(self.by_name)
        try:
            stop.call(run)
        finally:
            self.last_pass = None
