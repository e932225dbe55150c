"""Following a model's forward passes while it generates.

With the KV cache on, `generate` runs the model once on the whole prompt and then once per new
token on that token alone: a point's hook sees positions [0, P) first, then [P + k, P + k + 1).
Without the cache, each pass covers the whole sequence again (its new position is the last).
`pass_window` says which positions a pass covers; `Steps` follows the passes for the edits whose
decision varies (`follow` hooks them: before a pass, each such edit decides what it writes), and
each captured point follows them on its own (`keep.Kept.file`), so nothing else runs per token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from ..errors import HookscopeError
from .edits import StepEdit


def pass_window(filled: int, length: int) -> tuple[int, int]:
    """The sequence positions a forward pass over `length` positions covers, once positions
    [0, filled) have been computed by earlier passes."""
    if filled == 0:
        return 0, length  # the prompt
    if length == 1:
        return filled, filled + 1  # one new token, the rest in the KV cache
    if length == filled + 1:
        return 0, length  # no cache: the whole sequence again
    raise HookscopeError(
        f"a forward pass over {length} positions after {filled} were computed: "
        "this decoding mode does not run one token per step"
    )


@dataclass
class Steps:
    """Which sequence positions the current forward pass covers (for edits whose decision varies)."""

    prompt_length: int
    filled: int = 0  # positions [0, filled) have been computed by an earlier pass
    window: tuple[int, int] = (0, 0)  # positions the current pass covers

    def start(self, length: int) -> None:
        self.window = pass_window(self.filled, length)


def _input_length(args: tuple, kwargs: dict) -> int | None:
    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), args[0] if args else None):
        if isinstance(value, Tensor) and value.ndim >= 2:
            return value.shape[1]
    return None


def check_cache_filled(kwargs: dict, filled: int, cache_keys: Sequence[str]) -> None:
    """A one-token step reads the earlier positions from its KV cache: an empty cache means the model
    computes the new token without its context, and every token and activation after the prompt is
    wrong. TransformerLens 4.3's bridge does that with transformers >= 5.24 (its attention neither
    fills nor reads the cache transformers gives it), silently; refuse instead. Only an empty cache
    is refused: a sliding-window cache may hold fewer positions than were computed."""
    for key in cache_keys:
        cache = kwargs.get(key)
        if cache is not None and callable(getattr(cache, "get_seq_length", None)):
            if cache.get_seq_length() == 0:
                raise HookscopeError(
                    f"generate ran a one-token step after {filled} positions with an empty KV cache: the "
                    "model computed the new token without its context, so its tokens and activations would "
                    "be wrong. TransformerLens 4.3's TransformerBridge does this with transformers >= 5.24; "
                    "pass use_past_kv_cache=False (a bridge) or use_cache=False (each step then recomputes "
                    "the whole sequence), or install transformers<5.24"
                )
            return


@contextlib.contextmanager
def follow(
    first: nn.Module, last: nn.Module, steps: Steps, step_edits: list[StepEdit], cache_keys: Sequence[str]
) -> Iterator[None]:
    """Where an edit's decision varies: a pre-hook that tells those edits which positions the pass
    covers, and a forward hook that marks them computed. Plain torch hooks on the modules that start
    and end a pass (the root, or on a HookedTransformer, whose generate calls `forward` directly, its
    first block and its unembed), which run eagerly under every compile policy (`full` compiles
    forward, not hooks). Otherwise one pre-hook that checks the first cached step's KV cache and
    removes itself: nothing runs per token (captures follow the passes on their own, see `Kept.file`).
    Nothing here reads a tensor's values: no step waits for the device."""

    varying = [e for e in step_edits if not e.fixed]
    cache_checked = False  # the first cached step tells: a cache that one fills stays filled

    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        nonlocal cache_checked
        length = _input_length(args, kwargs)
        if length is None:
            raise HookscopeError("cannot tell the sequence length of a forward pass during generate")
        steps.start(length)
        if not cache_checked and steps.filled > 0:
            cache_checked = True
            if length == 1:  # one new token, the rest in the KV cache
                check_cache_filled(kwargs, steps.filled, cache_keys)
        for step_edit in varying:
            step_edit.prepare(*steps.window)
        if not varying and cache_checked:  # nothing more to follow (torch runs a copy of the hook list)
            for handle in handles:
                handle.remove()

    def after(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        steps.filled = steps.window[1]

    handles = [
        first.register_forward_pre_hook(before, with_kwargs=True),
        last.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
