"""Attach and detach hooks by point name.

One idea: a `Hooks` set remembers exactly the torch handles it added and removes exactly those
(in `finally` / `__exit__`), so an exception mid-forward never leaves a hook behind and the
model's own hooks are never touched.

A hook is a function `fn(activation, hook) -> new_activation | None` on the canonical tensor
(e.g. `[batch, pos, head, d_head]` for `attn.q`). Nothing here ever calls `repr()` on `fn`:
a `functools.partial` holding a dict of GPU tensors attaches as fast as a bare function.
`Hook.name` builds a readable label only when someone asks for it. `hs.hooks` / `hs.Hooks` are
public; the raw `Hook` and the permanent `add_hook` are extension API: import them from here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from .arch import Arch, PointSpec, arch_of, state_of
from .arch.base import ROOT, Call
from .errors import HookscopeError
from .model_inputs import attention_mask_of

HookFn = Callable[[Tensor, "Hook"], Tensor | None]


class Hook:
    """A handle on one attached hook; `remove()` detaches it.

    For `Hooks.forward` the Hook is itself the callable torch runs (an `_OnOutput` / `_OnInput`):
    attaching one makes one object and one torch handle, no closure, no list; nothing names it."""

    __slots__ = ("spec", "fn", "kind", "_run", "_handle", "_held")

    def __init__(self, spec: PointSpec, fn: Callable, kind: str):
        # fn: what the hook is, as shown in its name; _run: what is called (a wrapper, for a
        # gradient hook or a profiler label, may stand between them)
        self.spec, self.fn, self.kind, self._run = spec, fn, kind, fn
        self._handle: Any = None  # the torch handle
        self._held: list | None = None  # further handles that live as long as the hook (holds)

    @property
    def point(self) -> str:
        return self.spec.name

    @property
    def name(self) -> str:
        """A readable label, built on demand (never at attach time)."""
        return f"{self.kind} hook {describe(self.fn)} on {self.spec.name}"

    def hold(self, handle: Any) -> None:
        """Remove `handle` (anything with `.remove()`) when this hook is removed."""
        self._held = [*(self._held or ()), handle]

    def remove(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()
        held, self._held = self._held, None
        for other in held or ():
            other.remove()

    @property
    def attached(self) -> bool:
        return self._handle is not None

    def __repr__(self) -> str:
        return f"<{self.name}>"


def describe(fn: Callable) -> str:
    """A short readable name for a callable, built without calling its repr()."""
    inner = getattr(fn, "func", None)  # functools.partial
    if inner is not None:
        return f"partial({describe(inner)})"
    qualname = getattr(fn, "__qualname__", None)
    if qualname is not None:  # functions, methods, classes
        return qualname
    # A callable object: its class names it; its repr() (which may walk a dict of tensors) is never called.
    return f"{type(fn).__qualname__} instance"


# --- the seam to a layer on top (the compile layer) -------------------------------------------


class Layer(Protocol):
    """What a layer on top of the core may change about how hooks run, registered per model in
    `arch.state_of(model).layer` (the compile layer registers one when it compiles a model). The
    core calls these two methods and nothing else; it never imports the layer."""

    def untraceable(self, model: nn.Module, spec: PointSpec, reason: str) -> Any | None:
        """A handle (`.remove()`) that keeps the hooks of `spec` out of any compiled graph while
        held, or None if they run eagerly anyway. `reason` says why (it may be warned once)."""

    def split_capture(self, capture: Any, specs: list[PointSpec]) -> list[PointSpec]:
        """Attach `capture`'s hooks for the specs it takes over; return the specs left to the
        capture's own (plain) path."""


class Held:
    """A handle on a reference-counted switch (see `hold`)."""

    __slots__ = ("_entry", "_holds", "_key")

    def __init__(self, holds: dict, key: Any):
        self._holds, self._key, self._entry = holds, key, holds[key]

    def remove(self) -> None:
        entry, self._entry = self._entry, None
        if entry is None:
            return  # already released
        entry[0] -= 1
        if entry[0] == 0:
            del self._holds[self._key]
            entry[1]()


def hold(model: nn.Module, key: Any, switch: Callable[[], Callable[[], None]]) -> Held:
    """A reference-counted switch on `model`: the first holder of `key` calls `switch()`, which
    flips something and returns how to flip it back; removing the last holder's handle does that.
    Acts as a hook handle, so a hook that needs the switch holds it exactly as long as it lives."""
    holds = state_of(model).holds
    entry = holds.get(key)
    if entry is None:
        entry = holds[key] = [0, None]
        try:
            entry[1] = switch()
        except BaseException:
            del holds[key]
            raise
    entry[0] += 1
    return Held(holds, key)


def _eager_attention(model: nn.Module) -> Held:
    """While any hook needs attention weights, the model runs eager attention (the only
    implementation that materialises them); its own kernel comes back with the last such hook."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise HookscopeError("attn.pattern needs a Hugging Face model (config._attn_implementation)")

    def switch() -> Callable[[], None]:
        before = config._attn_implementation
        config._attn_implementation = "eager"
        return lambda: setattr(config, "_attn_implementation", before)

    return hold(model, "eager attention", switch)


# --- which tensor a module call carries (one rule, also used by profiling) -------------------


def output_tensor(output: Any, item: int = 0) -> Tensor | None:
    """The activation a module returns: the output itself, or element `item` of a tuple / list /
    `ModelOutput` (attention modules return (out, weights)); None if that is not a tensor."""
    if isinstance(output, Tensor):
        return output
    if hasattr(output, "to_tuple"):  # transformers ModelOutput
        output = output.to_tuple()
    if isinstance(output, (tuple, list)) and item < len(output) and isinstance(output[item], Tensor):
        return output[item]
    return None


def input_tensor(args: tuple, kwargs: dict) -> tuple[Tensor, Any] | None:
    """The activation entering a module, and where it sits (0, or a keyword). Hugging Face layers
    take it as a keyword (`hidden_states=`), so pre-hooks see kwargs too."""
    if args and isinstance(args[0], Tensor):
        return args[0], 0
    if isinstance(kwargs.get("hidden_states"), Tensor):
        return kwargs["hidden_states"], "hidden_states"
    for key, value in kwargs.items():
        if isinstance(value, Tensor):
            return value, key
    return None


def _replace_output(output: Any, item: int | None, new: Tensor) -> Any:
    if item is None or isinstance(output, Tensor):
        return new
    if isinstance(output, (tuple, list)):
        out = list(output)
        out[item] = new
        return tuple(out) if isinstance(output, tuple) else out
    if hasattr(output, "to_tuple"):
        key = list(output.keys())[item]
        output[key] = new
        return output
    raise HookscopeError(f"cannot replace a tensor in a module output of type {type(output).__name__}")


def _replace_input(args: tuple, kwargs: dict, where: Any, new: Tensor) -> tuple[tuple, dict]:
    return ((new, *args[1:]), kwargs) if where == 0 else (args, {**kwargs, where: new})


class _OnOutput(Hook):
    """A hook on a module's output, called by torch as `hook(module, args, output)`: reads the
    point's canonical view, calls fn, writes back what it returns."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        spec = self.spec
        item, view = spec.item, spec.view
        if item is None:  # the whole output: the point's view reads several parts of it (arch/moe.py)
            raw = output
        else:
            raw = output if isinstance(output, Tensor) else output_tensor(output, item)
        if raw is None:
            raise HookscopeError(
                f"{spec.name}: cannot read a tensor from a module output of type {type(output).__name__}"
            )
        new = self._run(raw if view is None else view.get(raw), self)
        if new is None:
            return None
        return _replace_output(output, item, new if view is None else view.put(raw, new))


class _OnInput(Hook):
    """A hook on a module's input, called by torch as `hook(module, args, kwargs)` (a pre-forward
    hook with kwargs)."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        spec = self.spec
        item, view = spec.item, spec.view
        if item is None:  # the whole call: the view reads the module and all its arguments
            new = self._run(view.get(Call(module, args, kwargs)), self)
            return None if new is None else view.put(Call(module, args, kwargs), new)[1:]
        found = input_tensor(args, kwargs)
        if found is None:
            raise HookscopeError(f"{spec.name}: the module was called with no tensor input to read")
        raw, where = found
        new = self._run(raw if view is None else view.get(raw), self)
        if new is None:
            return None
        return _replace_input(args, kwargs, where, new if view is None else view.put(raw, new))


class _Sum:
    """The hook of a point written as a sum (`arch.base.SumOf`): its first half keeps the skip
    stream as the block keeps it, its second calls the point's hook on `skip + added` and writes
    back `new - skip` as what the sublayer adds, so that both branches read the new stream."""

    __slots__ = ("hook", "skip")

    def __init__(self, hook: Hook):
        self.hook, self.skip = hook, None

    def keep_skip(self, skip: Tensor, _: Hook) -> None:
        self.skip = skip

    def __call__(self, added: Tensor, _: Hook) -> Tensor | None:
        skip, self.skip = self.skip, None
        if skip is None:
            raise HookscopeError(
                f"{self.hook.point}: its block ran without the stream entering it being seen; "
                "hook attn.out or a raw module: point instead"
            )
        new = self.hook._run(skip + added, self.hook)
        return None if new is None else new - skip


def _sums_last(module: nn.Module) -> None:
    """Move the hooks that write a sum through this module's output (`_Sum`) after its other
    forward hooks: a hook on the sublayer's own point (attn.out), attached later, still runs
    before the stream it feeds (resid_mid) is read or written, as in TransformerLens."""
    hooks = module._forward_hooks
    for key in [key for key, hook in hooks.items() if isinstance(getattr(hook, "fn", None), _Sum)]:
        hooks.move_to_end(key)


def grad_leaf(act: Tensor, hook: Hook) -> Tensor:
    """The activation as a tensor autograd can differentiate with respect to: itself, or (frozen
    weights, token inputs) a fresh leaf that requires grad. The hook must return it, so that the
    rest of the forward uses it (a sliced view, one head of a fused q|k|v, is written back)."""
    if not torch.is_grad_enabled():
        raise HookscopeError(
            f"gradient hook on {hook.point}: the forward pass ran with gradients off "
            "(torch.no_grad / inference_mode); run it with gradients on"
        )
    return act if act.requires_grad else act.detach().requires_grad_()


def _grad_capture(fn: Callable[[Tensor, Hook], Tensor | None]) -> HookFn:
    """Turn a gradient hook into a forward hook that registers it on the activation."""

    def forward(act: Tensor, hook: Hook) -> Tensor:
        act = grad_leaf(act, hook)
        act.register_hook(lambda grad: fn(grad, hook))
        return act

    return forward


class Hooks:
    """A set of hooks on one model, removed together (`hs.hooks(model)`): `forward` reads or
    replaces an activation, `grad` its gradient, by point name; a hook's `repr()` is never called."""

    def __init__(self, model: nn.Module, arch: Arch | None = None):
        self.model = model
        self.arch = arch if arch is not None else arch_of(model)
        self._hooks: list[Hook] = []

    # attaching -----------------------------------------------------------------------------

    def forward(self, point: str | PointSpec, fn: HookFn, *, prepend: bool = False) -> Hook:
        """Call `fn(activation, hook)` when the point runs; a returned tensor replaces it."""
        spec = point if isinstance(point, PointSpec) else self.arch.spec(point)
        if spec.written_as is not None:
            return self._forward_as_sum(spec, fn, prepend)
        module = self.arch.module(self.model, spec)
        if spec.io == "output":
            hook: Hook = _OnOutput(spec, fn, "forward")
            if spec.needs_eager:
                hook.hold(_eager_attention(self.model))
            # (no keyword unless needed: torch's keyword handling is a share of an attach worth saving;
            # bench/HISTORY.md, Capture and hooks, "Keyword arguments to register_forward_hook")
            hook._handle = (
                module.register_forward_hook(hook, prepend=True)
                if prepend
                else module.register_forward_hook(hook)
            )
            if len(module._forward_hooks) > 1:
                _sums_last(module)
        else:
            hook = _OnInput(spec, fn, "forward")
            hook._handle = module.register_forward_pre_hook(hook, prepend=prepend, with_kwargs=True)
        self._hooks.append(hook)
        return hook

    def _forward_as_sum(self, spec: PointSpec, fn: HookFn, prepend: bool) -> Hook:
        """A hook on a point the model reads back from two places (resid_mid): two hooks, on the
        skip stream and on what the sublayer adds, so that what `fn` returns reaches both."""
        hook = Hook(spec, fn, "forward")
        written_as = spec.written_as
        both = _Sum(hook)
        skip = self.forward(written_as.skip, both.keep_skip, prepend=True)  # before any edit there
        self._hooks.remove(skip)
        hook.hold(skip)
        added = self.forward(written_as.added, both, prepend=prepend)
        self._hooks.remove(added)
        hook._handle = added
        self._hooks.append(hook)
        return hook

    def grad(self, point: str | PointSpec, fn: Callable[[Tensor, Hook], Tensor | None]) -> Hook:
        """Call `fn(grad, hook)` with d loss / d activation during backward; a returned tensor
        replaces the gradient. Uses a tensor hook (cheaper than a module backward hook)."""
        spec = self._spec(point)
        spec.require_writable("a gradient hook")
        hook = self.untraceable_forward(
            spec, _grad_capture(fn), reason="a gradient hook cannot be traced into a compiled graph"
        )
        hook.kind, hook.fn = "grad", fn
        return hook

    def untraceable_forward(self, point: str | PointSpec, fn: HookFn, *, reason: str) -> Hook:
        """A forward hook whose `fn` cannot run inside a compiled graph (`reason` says why): a
        layer on top (the compile layer) keeps the point out of any graph while it is attached."""
        hook = self.forward(point, fn)
        self._hold_untraceable(hook, reason)
        return hook

    def module_backward(self, point: str | PointSpec, fn: Callable) -> Hook:
        """A full backward hook on the point's module: `fn(module, grad_input, grad_output)`."""
        spec = self._spec(point)
        hook = self._keep(
            Hook(spec, fn, "backward"), self.arch.module(self.model, spec).register_full_backward_hook(fn)
        )
        self._hold_untraceable(hook, "a module backward hook cannot be traced into a compiled graph")
        return hook

    def module_forward(self, point: str | PointSpec, fn: Callable) -> Hook:
        """A plain forward hook on the point's module: `fn(module, args, output)`."""
        spec = self._spec(point)
        module = self.arch.module(self.model, spec)
        return self._keep(Hook(spec, fn, "forward"), module.register_forward_hook(fn))

    def module_pre_forward(self, point: str | PointSpec, fn: Callable) -> Hook:
        """A plain pre-forward hook on the point's module: `fn(module, args, kwargs)`."""
        spec = self._spec(point)
        handle = self.arch.module(self.model, spec).register_forward_pre_hook(fn, with_kwargs=True)
        return self._keep(Hook(spec, fn, "pre-forward"), handle)

    def pass_start(self, fn: Callable[[Tensor | None], None]) -> Hook:
        """Call `fn(attention_mask)` as each forward pass of the model starts, with the mask it is
        called with (None without one): the one root pre-hook that capture and edits use."""
        return self.module_pre_forward(ROOT, lambda module, args, kwargs: fn(attention_mask_of(kwargs)))

    def _keep(self, hook: Hook, handle: Any) -> Hook:
        hook._handle = handle
        self._hooks.append(hook)
        return hook

    def _spec(self, point: str | PointSpec) -> PointSpec:
        return point if isinstance(point, PointSpec) else self.arch.spec(point)

    def _hold_untraceable(self, hook: Hook, reason: str) -> None:
        layer = state_of(self.model).layer
        handle = layer.untraceable(self.model, hook.spec, reason) if layer is not None else None
        if handle is not None:
            hook.hold(handle)

    # removing ------------------------------------------------------------------------------

    def remove(self) -> None:
        """Remove every hook this set added (and nothing else)."""
        while self._hooks:
            self._hooks.pop().remove()

    def __enter__(self) -> Hooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __iter__(self):
        return iter(list(self._hooks))

    def __len__(self) -> int:
        return len(self._hooks)

    def describe(self) -> list[str]:
        """Readable labels of the attached hooks (this is where names get built)."""
        return [h.name for h in self._hooks]


def hooks(model: nn.Module) -> Hooks:
    """A hook set for `model`, to use as a `with` block (removed on exit, also on errors).

    Returns:
        Hooks: an empty set; `h.forward(point, fn)` / `h.grad(point, fn)` attach to it.

    Raises:
        UnknownPointError: from `h.forward` / `h.grad`, for a name the model does not have."""
    return Hooks(model)


def add_hook(model: nn.Module, point: str, fn: HookFn, *, kind: str = "forward") -> Hook:
    """A permanent hook: stays until `hook.remove()`."""
    h = Hooks(model)
    if kind == "forward":
        return h.forward(point, fn)
    if kind == "grad":
        return h.grad(point, fn)
    raise HookscopeError(f"unknown hook kind {kind!r}: use 'forward' or 'grad'")


def hook_count(model: nn.Module) -> int:
    """How many forward / pre-forward / backward hooks sit on the model's modules (for tests
    and debugging: compare before and after a block)."""
    return sum(
        len(m._forward_hooks)
        + len(m._forward_pre_hooks)
        + len(m._backward_hooks)
        + len(getattr(m, "_backward_pre_hooks", {}))
        for m in model.modules()
    )
