"""What a dataset reads: the columns its `point` argument names, and how they come out of a batch
(store/dataset.py).

A name may be a glob (`blocks.*.resid_post`, matched with fnmatch against the store's columns).
Without `stack`, every matched column comes out on its own (a dict keyed by column name). With
`stack=True`, each glob's columns come out as one tensor `[rows, columns, *row shape]`, in block
order (numbers in the names compared as numbers: block 10 after block 9), keyed by the glob; a plain
name (`token_ids`) still comes out on its own. Several globs (a cross-layer transcoder's `mlp.in` and
`mlp.out`) must match the same blocks, so that index l of every stack is the same block. A column
stored stacked (`hookscope extract --stack`) is named by its glob and read as any column: the name
finds it before any matching, and it comes out `[rows, blocks, ...]` as it is, with `stack` or without.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import StoreError
from .manifest import Column


@dataclass(frozen=True)
class Selected:
    """`names`: every column read, each once; `outputs`: output key -> the columns it holds (one
    column for a plain key, the stacked columns in order for a stacked one); `stacked`: the keys
    that are stacks; `single`: a lone key comes out as a bare tensor rather than a dict."""

    names: list[str]
    outputs: dict[str, list[str]]
    stacked: frozenset[str]
    single: bool


def natural_key(name: str) -> list[int | str]:
    """`blocks.10.x` after `blocks.9.x`: digit runs compared as numbers."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _is_glob(name: str) -> bool:
    return any(ch in name for ch in "*?[")


def select(columns: dict[str, Column], point: str | Sequence[str], stack: bool, where: str) -> Selected:
    """The columns `point` names in a store whose columns are `columns` (checked: each exists, each
    glob matches something, a stack's columns share shape and dtype)."""
    patterns = [point] if isinstance(point, str) else list(point)
    if not patterns:
        raise StoreError(
            "no column named: pass a point name, a glob such as 'blocks.*.resid_post', or a list"
        )
    outputs: dict[str, list[str]] = {}
    stacked: set[str] = set()
    for pattern in patterns:
        if pattern in columns:  # a stored stack's name is its glob (`--stack`): the column itself
            matched = [pattern]
        elif _is_glob(pattern):
            matched = sorted(fnmatch.filter(columns, pattern), key=natural_key)
            if not matched:
                raise StoreError(f"{where}: {pattern!r} matches no column; the store has {list(columns)}")
        else:
            raise StoreError(
                f"{where}: no column {pattern!r}; the store has {list(columns)}"
                + _in_a_stack(columns, pattern)
            )
        if stack and _is_glob(pattern) and pattern not in columns:
            outputs[pattern] = matched
            stacked.add(pattern)
        else:
            outputs.update({name: [name] for name in matched})
    names = list(dict.fromkeys(n for group in outputs.values() for n in group))
    if len(names) < sum(len(group) for group in outputs.values()):
        raise StoreError(
            f"{where}: {patterns} name some columns twice (a stack's columns may be in no "
            "other stack and not named on their own)"
        )
    _check_stacks(columns, {k: v for k, v in outputs.items() if k in stacked}, where)
    lone = stack or not _is_glob(point) or point in columns  # a stored stack is one column
    single = isinstance(point, str) and len(outputs) == 1 and lone
    return Selected(names, outputs, frozenset(stacked), single)


def _in_a_stack(columns: dict[str, Column], name: str) -> str:
    """Where `name` is stored when a stacked column (`--stack`) holds it, in words, else ''."""
    for column in columns:
        if _is_glob(column) and fnmatch.fnmatchcase(name, column):
            return (
                f"; {name} is stored inside the stacked column {column!r} (written with --stack): read "
                f"that column, [rows, blocks, ...] in block order, and index its second dimension"
            )
    return ""


def _check_stacks(columns: dict[str, Column], outputs: dict[str, list[str]], where: str) -> None:
    for pattern, group in outputs.items():
        kinds = {(columns[n].shape, columns[n].dtype) for n in group}
        if len(kinds) > 1:
            shown = ", ".join(f"{n} {list(columns[n].shape)} {columns[n].dtype}" for n in group)
            raise StoreError(
                f"{where}: {pattern!r} matches columns of different shapes or dtypes ({shown}); "
                "stack=True needs one shape and dtype: narrow the pattern"
            )
    if len(outputs) > 1:
        blocks = {p: [_numbers(n) for n in group] for p, group in outputs.items()}
        first, *rest = blocks.items()
        for p, b in rest:
            if b != first[1]:
                raise StoreError(
                    f"{where}: stacked patterns must match the same blocks so that index l "
                    f"of each stack is one block: {first[0]!r} matches {outputs[first[0]]}, "
                    f"{p!r} matches {outputs[p]}"
                )


def _numbers(name: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", name))
