"""Attach and detach hooks by point name.

One idea: a `Hooks` set remembers exactly the torch handles it added and removes exactly those
(in `finally` / `__exit__`), so an exception mid-forward never leaves a hook behind and the
model's own hooks are never touched.

A hook is a function `fn(activation, hook) -> new_activation | None` on the canonical tensor
(e.g. `[batch, pos, head, d_head]` for `attn.q`). Nothing here ever calls `repr()` on `fn`:
a `functools.partial` holding a dict of GPU tensors attaches as fast as a bare function.
`Hook.name` builds a readable label only when someone asks for it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .arch import Arch, PointSpec, arch_of
from .arch.base import Call
from .compile import hold_eager, region_of
from .errors import HookscopeError

HookFn = Callable[[Tensor, "Hook"], Tensor | None]


class Hook:
    """A handle on one attached hook."""

    __slots__ = ("spec", "fn", "kind", "_handles")

    def __init__(self, spec: PointSpec, fn: Callable, kind: str, handles: list):
        self.spec, self.fn, self.kind, self._handles = spec, fn, kind, handles

    @property
    def point(self) -> str:
        return self.spec.name

    @property
    def name(self) -> str:
        """A readable label, built on demand (never at attach time)."""
        return f"{self.kind} hook {describe(self.fn)} on {self.spec.name}"

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

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


def call_model(model: nn.Module, inputs: Any, **options: Any) -> Any:
    """Run `model` on a tensor (input ids), a mapping (keyword inputs) or a tuple (positional);
    `options` are extra keyword arguments, which a mapping's own keys override."""
    if isinstance(inputs, Mapping):
        return model(**{**options, **inputs})
    if isinstance(inputs, tuple):
        return model(*inputs, **options)
    return model(inputs, **options)


# --- reading and replacing the tensor a point names ---------------------------------------


def _pick_output(output: Any, item: int | None) -> Tensor:
    if item is None:  # the whole output: the point's view reads several parts of it (arch/moe.py)
        return output
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return output[item]
    if hasattr(output, "to_tuple"):  # transformers ModelOutput
        return output.to_tuple()[item]
    raise HookscopeError(f"cannot read a tensor from a module output of type {type(output).__name__}")


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


def _pick_input(args: tuple, kwargs: dict) -> tuple[Tensor, Any]:
    """The activation entering a module. Hugging Face layers take it as a keyword
    (`hidden_states=`), so pre-hooks see kwargs too."""
    if args and isinstance(args[0], Tensor):
        return args[0], 0
    if isinstance(kwargs.get("hidden_states"), Tensor):
        return kwargs["hidden_states"], "hidden_states"
    for key, value in kwargs.items():
        if isinstance(value, Tensor):
            return value, key
    raise HookscopeError("the module was called with no tensor input to read")


def _replace_input(args: tuple, kwargs: dict, where: Any, new: Tensor) -> tuple[tuple, dict]:
    if where == 0:
        return (new, *args[1:]), kwargs
    return args, {**kwargs, where: new}


def _module_hook(spec: PointSpec, fn: HookFn, hook: Hook) -> Callable:
    """The torch-level hook: read the canonical view, call fn, write back what it returns."""
    view, item = spec.view, spec.item
    get = view.get if view else None
    put = view.put if view else None

    if spec.io == "output":
        def on_output(module: nn.Module, args: tuple, output: Any) -> Any:
            raw = output if isinstance(output, Tensor) else _pick_output(output, item)
            new = fn(get(raw) if get else raw, hook)
            if new is None:
                return None
            return _replace_output(output, item, put(raw, new) if put else new)

        return on_output

    def on_input(module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if item is None:  # the whole call: the view reads the module and all its arguments
            new = fn(get(Call(module, args, kwargs)), hook)
            return None if new is None else put(Call(module, args, kwargs), new)[1:]
        raw, where = _pick_input(args, kwargs)
        new = fn(get(raw) if get else raw, hook)
        if new is None:
            return None
        return _replace_input(args, kwargs, where, put(raw, new) if put else new)

    return on_input


def require_writable(spec: PointSpec, what: str) -> None:
    """Refuse edits / gradients on a point whose value the model never reads back."""
    if spec.needs_eager:
        raise HookscopeError(
            f"{what} on {spec.name}: Hugging Face attention returns its weights after using them, so "
            "changing them changes nothing; edit attn.q / attn.k / attn.z instead "
            "(or use a TransformerLens model)"
        )


def _grad_capture(fn: Callable[[Tensor, Hook], Tensor | None]) -> HookFn:
    """Turn a gradient hook into a forward hook that registers it on the activation.

    The activation must be the tensor the rest of the forward uses, so a sliced view (one head
    of a fused q|k|v) is written back through `put`; a point that does not require grad yet
    (frozen weights, token inputs) gets a fresh leaf that does.
    """

    def forward(act: Tensor, hook: Hook) -> Tensor:
        if not torch.is_grad_enabled():
            raise HookscopeError(
                f"gradient hook on {hook.point}: the forward pass ran with gradients off "
                "(torch.no_grad / inference_mode); run it with gradients on"
            )
        if not act.requires_grad:
            act = act.detach().requires_grad_()
        act.register_hook(lambda grad: fn(grad, hook))
        return act

    return forward


class _EagerAttention:
    """While any hook needs attention weights, the model runs eager attention (the only
    implementation that materialises them); the model's own kernel comes back when the last
    such hook is removed. Acts as one more handle of the hook that needs it."""

    _holders: weakref.WeakKeyDictionary[nn.Module, list] = weakref.WeakKeyDictionary()

    def __init__(self, model: nn.Module):
        self.model = model
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "_attn_implementation"):
            raise HookscopeError("attn.pattern needs a Hugging Face model (config._attn_implementation)")
        state = self._holders.setdefault(model, [0, config._attn_implementation])
        if state[0] == 0:
            state[1] = config._attn_implementation
            config._attn_implementation = "eager"
        state[0] += 1
        self._released = False

    def remove(self) -> None:
        if self._released:
            return
        self._released = True
        state = self._holders[self.model]
        state[0] -= 1
        if state[0] == 0:
            self.model.config._attn_implementation = state[1]


class Hooks:
    """A set of hooks on one model, removed together.

    >>> with hs.hooks(model) as h:
    ...     h.forward("blocks.3.resid_post", lambda x, hook: x * 0)
    ...     model(ids)
    """

    def __init__(self, model: nn.Module, arch: Arch | None = None):
        self.model = model
        self.arch = arch or arch_of(model)
        self._hooks: list[Hook] = []

    # attaching -----------------------------------------------------------------------------

    def forward(self, point: str | PointSpec, fn: HookFn, *, prepend: bool = False,
                eager: str | None = None) -> Hook:
        """Call `fn(activation, hook)` when the point runs; a returned tensor replaces it.

        `eager`: why `fn` cannot be traced by torch.compile; if the point sits inside a compiled
        region (see `hookscope.compile`), that region then runs eagerly while the hook is attached."""
        spec = point if isinstance(point, PointSpec) else self.arch.spec(point)
        module = self.arch.module(self.model, spec)
        handles: list = []
        hook = Hook(spec, fn, "forward", handles)
        torch_hook = _module_hook(spec, fn, hook)
        if spec.needs_eager:
            handles.append(_EagerAttention(self.model))
        if eager is not None:
            handles.extend(self._hold_eager(spec, eager))
        if spec.io == "output":
            handles.append(module.register_forward_hook(torch_hook, prepend=prepend))
        else:
            handles.append(module.register_forward_pre_hook(torch_hook, prepend=prepend, with_kwargs=True))
        self._hooks.append(hook)
        return hook

    def grad(self, point: str | PointSpec, fn: Callable[[Tensor, Hook], Tensor | None]) -> Hook:
        """Call `fn(grad, hook)` with d loss / d activation during backward; a returned tensor
        replaces the gradient. Uses a tensor hook (cheaper than a module backward hook)."""
        spec = point if isinstance(point, PointSpec) else self.arch.spec(point)
        require_writable(spec, "a gradient hook")
        hook = self.forward(spec, _grad_capture(fn),
                            eager="a gradient hook cannot be traced into a compiled graph")
        hook.kind, hook.fn = "grad", fn
        return hook

    def module_backward(self, point: str | PointSpec, fn: Callable) -> Hook:
        """A full backward hook on the point's module: `fn(module, grad_input, grad_output)`."""
        spec = point if isinstance(point, PointSpec) else self.arch.spec(point)
        module = self.arch.module(self.model, spec)
        handles = [module.register_full_backward_hook(fn),
                   *self._hold_eager(spec, "a module backward hook cannot be traced into a compiled graph")]
        hook = Hook(spec, fn, "backward", handles)
        self._hooks.append(hook)
        return hook

    def module_forward(self, point: str | PointSpec, fn: Callable) -> Hook:
        """A plain forward hook on the point's module: `fn(module, args, output)`."""
        spec = point if isinstance(point, PointSpec) else self.arch.spec(point)
        module = self.arch.module(self.model, spec)
        handles = [module.register_forward_hook(fn)]
        hook = Hook(spec, fn, "forward", handles)
        self._hooks.append(hook)
        return hook

    def _hold_eager(self, spec: PointSpec, reason: str) -> list:
        region = region_of(self.model, spec.module)
        return [] if region is None else [hold_eager(self.model, region, reason)]

    def module_pre_forward(self, point: str | PointSpec, fn: Callable) -> Hook:
        """A plain pre-forward hook on the point's module: `fn(module, args, kwargs)`."""
        spec = point if isinstance(point, PointSpec) else self.arch.spec(point)
        module = self.arch.module(self.model, spec)
        handles = [module.register_forward_pre_hook(fn, with_kwargs=True)]
        hook = Hook(spec, fn, "pre-forward", handles)
        self._hooks.append(hook)
        return hook

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
    """A hook set for `model`, to use as a `with` block (removed on exit, also on errors)."""
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
    n = 0
    for m in model.modules():
        n += len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        n += len(getattr(m, "_backward_pre_hooks", {}))
    return n
