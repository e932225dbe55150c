"""`hs.collect` and `hs.points` on any model: a served engine (a vLLM `LLM`) goes to its engine
module, anything else to the core (`capture.py`) unchanged.

The core sits above the engines in the import table and never imports them; this front sits below
both, so the one verb users know reaches either. An nn.Module pays one type check.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from .capture import PointDict, PointInfo
from .capture import collect as core_collect
from .capture import points as core_points
from .engines import vllm
from .errors import EngineError

# the core verbs' names and docstrings; the annotations are this module's own (a list of PointDict
# for an engine's prompts)
_DOCS = ("__module__", "__name__", "__qualname__", "__doc__")


@functools.wraps(core_collect, assigned=_DOCS)
def collect(
    model: Any, inputs: Any, points: str | Sequence[str], **options: Any
) -> PointDict | list[PointDict]:
    if vllm.is_llm(model):
        if options:
            raise EngineError(
                f"hs.collect on a vLLM engine takes no options yet (got {', '.join(options)}): it keeps "
                "every token of every prompt; select rows from what it returns"
            )
        return vllm.collect(model, inputs, points)
    return core_collect(model, inputs, points, **options)


@functools.wraps(core_points, assigned=_DOCS)
def points(model: Any, example: Any = None, *, pattern: str | None = None) -> list[PointInfo]:
    if vllm.is_llm(model):
        infos = vllm.points(model)
        if pattern is not None:
            from .names import expand

            keep = set(expand(pattern, [p.name for p in infos]))
            infos = [p for p in infos if p.name in keep]
        return infos
    return core_points(model, example, pattern=pattern)
