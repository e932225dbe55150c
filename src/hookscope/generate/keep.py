"""One point's captured positions across generation steps, filed pass by pass.

A pass covers sequence positions [offset, offset + n). Of each, a `Kept` holds only what its
positions selection can still need: the positions the selection names counting from the start
(`Selection.at(offset).window(n)`), and the last `Selection.tail` positions seen, for those it
names counting from the end (known only once the sequence is complete). At the end, the
selection is applied with `hs.collect`'s rules (and errors) to the sequence's position numbers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..selection import Selection


class _SequenceDims:
    """The dims of a [batch, position] table of sequence positions (for `Selection.select`)."""

    pos_dim, head_dim = 1, None


_SEQUENCE = _SequenceDims()


class Kept:
    """One point's kept positions: chunks of [batch, n, ...] with the sequence position of each
    column, and the tail."""

    def __init__(self, selection: Selection):
        self.selection = selection  # positions only, parsed once by Selection.of
        self.tail = selection.tail
        self.chunks: list[tuple[Tensor, list[int]]] = []
        self.tail_x: Tensor | None = None
        self.tail_pos: list[int] = []

    def add(self, chunk: Tensor, start: int) -> None:
        """File the pass's `chunk` ([batch, n, ...]), which holds sequence positions from `start` on."""
        n = chunk.shape[1]
        wanted = None if self.selection.positions is None else self.selection.at(start).window(n)
        if wanted is None or bool(wanted.all()):
            self.chunks.append((chunk, list(range(start, start + n))))
        elif bool(wanted.any()):
            idx = wanted.nonzero().flatten()
            self.chunks.append((chunk.index_select(1, idx.to(chunk.device)), (idx + start).tolist()))
        if self.tail:
            x = chunk if self.tail_x is None else torch.cat([self.tail_x, chunk], dim=1)
            pos = self.tail_pos + list(range(start, start + n))
            self.tail_x, self.tail_pos = x[:, -self.tail:], pos[-self.tail:]

    def result(self, total: int, batch: int) -> Tensor:
        """The selection over the whole sequence of `total` positions, as `hs.collect` shapes it."""
        if self.selection.positions is None:
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
