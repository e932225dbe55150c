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
from ..store.selected import natural_key

Groups = dict[str, list[str]]  # column name (the glob) -> the points stacked in it, in block order


def stack_groups(patterns: Sequence[str], points: Sequence[str]) -> Groups:
    """Each glob of `patterns` -> the resolved `points` it matches, in block order; a point that two
    globs match is refused (a row may hold it once)."""
    groups: Groups = {}
    for pattern in patterns:
        if any(ch in pattern for ch in "*?["):
            groups[pattern] = sorted((p for p in points if fnmatch.fnmatchcase(p, pattern)), key=natural_key)
    seen: dict[str, str] = {}
    for pattern, members in groups.items():
        for point in members:
            if point in seen:
                raise HookscopeError(f"--stack: {point} is matched by both {seen[point]!r} and {pattern!r}; "
                                     "a point can be stacked in one column only: make the globs disjoint")
            seen[point] = pattern
    return groups


def stacked(acts: dict[str, torch.Tensor], groups: Groups,
            into: Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor | None],
            done_with: Callable[[torch.Tensor], None]) -> dict[str, torch.Tensor]:
    """`acts` with each group's points replaced by one `[rows, len(group), ...]` tensor, made where
    they are (on the CPU in a buffer from `into`; `done_with` then takes each point's own buffer
    back for the next batch)."""
    if not groups:
        return acts
    out = {name: a for name, a in acts.items() if not any(name in g for g in groups.values())}
    for column, members in groups.items():
        parts = [acts[m] for m in members]
        kinds = {(tuple(p.shape), p.dtype, p.device) for p in parts}
        if len(kinds) > 1:
            shown = ", ".join(f"{m} {list(p.shape)}" for m, p in zip(members, parts, strict=True))
            raise HookscopeError(f"--stack: {column!r} matches points of different shapes ({shown}); a "
                                 "stacked column needs one shape: narrow the glob or leave --stack out")
        first = parts[0]
        shape = (first.shape[0], len(parts), *first.shape[1:])
        buffer = into(shape, first.dtype, first.device) if first.device.type == "cpu" else None
        out[column] = torch.stack(parts, dim=1) if buffer is None else torch.stack(parts, dim=1, out=buffer)
        for part in parts:
            done_with(part)
    return out
