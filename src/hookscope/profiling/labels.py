"""`record_function` ranges per block (forward and backward) and per hooked point.

The eager profiler cannot name modules (`with_modules` does nothing in eager mode, `with_stack`
names them only by class), so blocks get our own ranges, opened and closed by module hooks.
Every hook first asks `torch._C._autograd._profiler_enabled()` and does nothing else when no
profiler runs: the question costs a fraction of what a bare `record_function` costs even then
(bench/HISTORY.md, Profiling).

Backward ranges: a block's backward starts when the gradient of its output arrives and ends
when the gradient of its input is complete; both are tensor-gradient hooks registered during the
forward. A block's input is usually the previous block's output, so one hook per tensor closes
before it opens, and ranges never overlap. The autograd engine runs those hooks inside its own
per-node ranges, so the raw ranges straddle one node at each end; `backward_span` snaps them to
node boundaries when the report is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self

import torch
from torch import Tensor, nn
from torch.autograd.profiler import record_function

from ..arch import Arch, PointSpec
from ..hooks import Hook, Hooks, input_tensor, output_tensor

profiler_enabled = torch._C._autograd._profiler_enabled

PREFIX = "hs::"
STEP = PREFIX + "step"
BACKWARD_SUFFIX = ".backward"
HOOK = PREFIX + "hook:"
HOOK_BACKWARD = PREFIX + "hook.backward:"
ENGINE_NODE = "autograd::engine::evaluate_function:"


def block_name(index: int) -> str:
    return f"blocks.{index}"


def block_label(index: int) -> str:
    return PREFIX + block_name(index)


def backward_label(index: int) -> str:
    return block_label(index) + BACKWARD_SUFFIX


def first_tensor(value: Any) -> Tensor | None:
    """The activation a module returns (or a model's first output): the rule of
    `hooks.output_tensor`, so profiling and hooks read the same tensor."""
    return output_tensor(value)


def profiled_blocks(arch: Arch) -> list[str]:
    """The paths of the blocks a step runs: all of them, or on a model loaded with `points=` the
    blocks whose weights were loaded (a step stops where they end)."""
    if arch.loaded is None:
        return arch.block_paths
    return arch.block_paths[: arch.loaded.blocks_loaded]


def block_labels(arch: Arch, *, backward: bool) -> list[str]:
    """Every profiled block's forward label in order, then (with backward) the backward labels in
    the order backward runs them (last block first)."""
    n = len(profiled_blocks(arch))
    forward = [block_label(i) for i in range(n)]
    return forward + ([backward_label(i) for i in reversed(range(n))] if backward else [])


class _OpenRanges:
    """Ranges opened by hooks and not yet closed, by label (a stack each: calls can nest)."""

    def __init__(self) -> None:
        self._open: dict[str, list[record_function]] = {}

    def open(self, label: str) -> None:
        self._open.setdefault(label, []).append(record_function(label).__enter__())

    def close(self, label: str) -> None:
        stack = self._open.get(label)
        if stack:
            stack.pop().__exit__(None, None, None)

    def close_all(self) -> None:
        for stack in self._open.values():
            while stack:
                stack.pop().__exit__(None, None, None)


class _GradMarks:
    """One gradient hook per tensor that closes, then opens, backward ranges."""

    def __init__(self, ranges: _OpenRanges) -> None:
        self._ranges = ranges
        # id -> (tensor, labels to close, labels to open); the tensor is held so its id stays
        # unique until the step ends (autograd keeps most of them alive anyway)
        self._marks: dict[int, tuple[Tensor, list[str], list[str]]] = {}

    def close_on(self, tensor: Tensor, label: str) -> None:
        self._entry(tensor)[1].append(label)

    def open_on(self, tensor: Tensor, label: str) -> None:
        self._entry(tensor)[2].append(label)

    def _entry(self, tensor: Tensor) -> tuple[Tensor, list[str], list[str]]:
        entry = self._marks.get(id(tensor))
        if entry is None:
            closes: list[str] = []
            opens: list[str] = []
            entry = self._marks[id(tensor)] = (tensor, closes, opens)
            # the hook holds the label lists, never the tensor: no reference cycle through it
            tensor.register_hook(lambda grad: self._fire(closes, opens))
        return entry

    def _fire(self, closes: list[str], opens: list[str]) -> None:
        for label in closes:
            self._ranges.close(label)
        for label in opens:
            self._ranges.open(label)

    def clear(self) -> None:
        self._marks.clear()


class BlockLabels:
    """Ranges `hs::blocks.N` around each block's forward (and `hs::blocks.N.backward` around its
    backward), while the `with` block lasts. Install it after the user's hooks: the ranges then
    open before and close after them, so a block's time includes its hooks.

    Call `end_step()` after each backward: it closes ranges whose closing gradient never came
    (a block input that needs no gradient) and releases the tensors marked in the step.
    """

    def __init__(self, model: nn.Module, arch: Arch, *, backward: bool = False):
        self.model, self.arch, self.backward = model, arch, backward
        self._ranges = _OpenRanges()
        self._marks = _GradMarks(self._ranges)
        self._handles: list = []

    def __enter__(self) -> Self:
        try:
            for index, path in enumerate(profiled_blocks(self.arch)):
                spec = PointSpec(name=block_name(index), module=path, io="output")
                module = self.arch.module(self.model, spec)
                pre, post = self._hooks_for(index)
                self._handles.append(module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True))
                self._handles.append(module.register_forward_hook(post, always_call=True))
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._remove()

    def end_step(self) -> None:
        self._ranges.close_all()
        self._marks.clear()

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.end_step()

    def _hooks_for(self, index: int) -> tuple[Callable, Callable]:
        label, bw_label = block_label(index), backward_label(index)
        opened: list[record_function] = []  # this block's forward ranges (calls can nest)
        marks = self._marks if self.backward else None

        def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not profiler_enabled():
                return
            opened.append(record_function(label).__enter__())
            if marks is not None and torch.is_grad_enabled():
                found = input_tensor(args, kwargs)
                x = found[0] if found is not None else None
                if x is not None and x.requires_grad:
                    marks.close_on(x, bw_label)

        def post(module: nn.Module, args: tuple, output: Any) -> None:
            if not opened:
                return
            if marks is not None and torch.is_grad_enabled():
                y = output_tensor(output)
                if y is not None and y.requires_grad:
                    marks.open_on(y, bw_label)
            opened.pop().__exit__(None, None, None)

        return pre, post


def _labelled(label: str, fn: Callable) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        if not profiler_enabled():
            return fn(*args, **kwargs)
        with record_function(label):
            return fn(*args, **kwargs)

    return call


class LabelledHooks(Hooks):
    """`Hooks` whose functions run inside a `hs::hook:<point>` range (forward side) or
    `hs::hook.backward:<point>` range (gradient and module-backward hooks), so the profile shows
    what each hooked point's hooks cost. `hook.fn` stays the user's function."""

    def forward(self, point: str | PointSpec, fn: Callable, **options: Any) -> Hook:
        return self._attach(super().forward, HOOK, point, fn, options)

    def grad(self, point: str | PointSpec, fn: Callable, **options: Any) -> Hook:
        return self._attach(super().grad, HOOK_BACKWARD, point, fn, options)

    def module_forward(self, point: str | PointSpec, fn: Callable, **options: Any) -> Hook:
        return self._attach(super().module_forward, HOOK, point, fn, options)

    def module_pre_forward(self, point: str | PointSpec, fn: Callable, **options: Any) -> Hook:
        return self._attach(super().module_pre_forward, HOOK, point, fn, options)

    def module_backward(self, point: str | PointSpec, fn: Callable, **options: Any) -> Hook:
        return self._attach(super().module_backward, HOOK_BACKWARD, point, fn, options)

    def _attach(
        self, attach: Callable, prefix: str, point: str | PointSpec, fn: Callable, options: dict
    ) -> Hook:
        spec = point if isinstance(point, PointSpec) else self.arch.spec(point)
        hook = attach(spec, _labelled(prefix + spec.name, fn), **options)
        hook.fn = fn
        return hook
