"""`--stack`: each glob of the points stored as one column, its blocks side by side in every row.

A crosscoder reads one point at every layer at once, a cross-layer transcoder every layer's MLP
input and output. Stored as one column per point, a shuffled batch of such rows gathers `layers`
separate pieces per row; stored stacked, `[rows, layers, *row shape]`, each row's layers are one
piece of memory, and a read gathers them as it gathers one point's rows. The column is named by
the glob (`blocks.*.resid_post`), its blocks in the order a stacked read gives them
(store/selected.py: block 10 after block 9). The grouping is one of the store's settings, so a
store is resumed only with the same `--stack`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence

import torch

from ..errors import HookscopeError
from ..names import is_pattern
from ..store.selected import natural_key

Groups = dict[str, list[str]]  # column name (the glob) -> the points stacked in it, in block order


def stack_groups(patterns: Sequence[str], points: Sequence[str]) -> Groups:
    """Each glob of `patterns` -> the resolved `points` it matches, in block order; a point that two
    globs match is refused (a row may hold it once)."""
    groups: Groups = {}
    for pattern in patterns:
        if is_pattern(pattern):
            groups[pattern] = sorted((p for p in points if fnmatch.fnmatchcase(p, pattern)), key=natural_key)
    seen: dict[str, str] = {}
    for pattern, members in groups.items():
        for point in members:
            if point in seen:
                raise HookscopeError(
                    f"--stack: {point} is matched by both {seen[point]!r} and {pattern!r}; "
                    "a point can be stacked in one column only: make the globs disjoint"
                )
            seen[point] = pattern
    return groups


class Slots:
    """Where a CPU capture writes each stacked point's kept rows: its slot `[:, l]` of the batch's
    one `[rows, blocks, ...]` buffer (`take` lends it), so that the stack costs no copy. A group's
    next buffer is taken when a point asks again, or with rows of another shape: the next batch."""

    def __init__(self, groups: Groups, take: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]):
        self.where = {
            point: (column, i) for column, members in groups.items() for i, point in enumerate(members)
        }
        self.size = {column: len(members) for column, members in groups.items()}
        self.take = take
        self.building: dict[str, tuple[torch.Tensor, set[int]]] = {}  # column -> its buffer, slots given

    def slot(self, point: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """`point`'s slot for rows of `shape` and `dtype`, or None when no stack holds it."""
        if point not in self.where:
            return None
        column, i = self.where[point]
        buffer, given = self.building.get(column, (None, set()))
        if buffer is None or i in given or buffer[:, i].shape != shape or buffer.dtype != dtype:
            buffer, given = self.take((shape[0], self.size[column], *shape[1:]), dtype), set()
            self.building[column] = (buffer, given)
        given.add(i)
        return buffer[:, i]

    def filled(self, column: str, parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The column's buffer when `parts` are its slots, each written where it was given."""
        buffer, given = self.building.get(column, (None, set()))
        if buffer is None or len(given) != len(parts):
            return None
        ok = all(
            p.data_ptr() == buffer[:, i].data_ptr()
            and p.stride() == buffer[:, i].stride()
            and p.shape == buffer[:, i].shape
            for i, p in enumerate(parts)
        )
        return buffer if ok else None


def stacked(acts: dict[str, torch.Tensor], groups: Groups, slots: Slots | None) -> dict[str, torch.Tensor]:
    """`acts` with each group's points replaced by one `[rows, len(group), ...]` tensor: the buffer
    their slots filled (`slots`: a CPU capture's), else stacked where they are (a copy)."""
    if not groups:
        return acts
    out = {name: a for name, a in acts.items() if not any(name in g for g in groups.values())}
    for column, members in groups.items():
        parts = [acts[m] for m in members]
        kinds = {(tuple(p.shape), p.dtype, p.device) for p in parts}
        if len(kinds) > 1:
            shown = ", ".join(f"{m} {list(p.shape)}" for m, p in zip(members, parts, strict=True))
            raise HookscopeError(
                f"--stack: {column!r} matches points of different shapes ({shown}); a "
                "stacked column needs one shape: narrow the glob or leave --stack out"
            )
        filled = None if slots is None else slots.filled(column, parts)
        out[column] = filled if filled is not None else _copied(parts)
    return out


def _copied(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The points stacked by a copy: on a device (cheap there), or what a capture did not write into
    its slots (a streamed or generating run)."""
    return torch.stack(list(parts), dim=1)
