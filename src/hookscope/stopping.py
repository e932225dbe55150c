"""One way to run a model until a point: a `Stop` ends a forward pass from a hook, and only the
`Stop` that ended it catches it.

The pass ends with `ForwardStopped`, a BaseException so that model code catching `Exception` cannot
swallow it. It carries the `Stop` that raised it: a stop inside another pass's stop (a profiled
step inside `with hs.capture(..., stop=True)`) is caught by its own `Stop`, and passes through
every other. Used by capture (after the last point), block streaming (after the block that runs),
profiling (where a `points=` model's weights end), the image source (at the first block, to count
its tokens), a `points=` load (to find the modules before the first block) and generation (its
pass on the last token, after the last captured point).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from torch import nn
from torch.utils.hooks import RemovableHandle

from .model_inputs import call_model, forward_parameters


class ForwardStopped(BaseException):
    """A forward pass ended on purpose by `stop`."""

    def __init__(self, stop: Stop):
        super().__init__()
        self.stop = stop


class Stop:
    """One early end of forward passes: `now()` from inside a pass (a hook), `before(module)` /
    `after(module)` as hooks on a module, and `run(model, inputs)` to run a pass it may end."""

    def now(self) -> NoReturn:
        raise ForwardStopped(self)

    def ended(self, exc: BaseException | None) -> bool:
        """Whether `exc` is this stop's end of a pass."""
        return isinstance(exc, ForwardStopped) and exc.stop is self

    def before(
        self, module: nn.Module, seen: Callable[[tuple, dict], None] | None = None, *, first: bool = False
    ) -> RemovableHandle:
        """A pre-hook that ends the pass as it reaches `module`, after `seen(args, kwargs)`; `first`:
        ahead of the module's other pre-hooks (a `points=` load's guard among them)."""

        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            if seen is not None:
                seen(args, kwargs)
            self.now()

        return module.register_forward_pre_hook(hook, with_kwargs=True, prepend=first)

    def after(self, module: nn.Module, seen: Callable[[Any], None] | None = None) -> RemovableHandle:
        """A forward hook that ends the pass once `module` has run, after `seen(output)` (after the
        module's forward hooks registered before it)."""

        def hook(_module: nn.Module, _args: tuple, output: Any) -> None:
            if seen is not None:
                seen(output)
            self.now()

        return module.register_forward_hook(hook)

    def run(self, model: nn.Module, inputs: Any, **options: Any) -> tuple[Any, bool]:
        """(the model's output, False), or (None, True) when this stop ended the pass (`call_model`'s
        `inputs` and `options`)."""
        return self.call(call_model, model, inputs, **options)

    def call(self, run: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, bool]:
        """`run(*args, **kwargs)`, any call that runs a model (a generation backend's pass on the last
        token, say): (its result, False), or (None, True) when this stop ended the pass it ran."""
        try:
            return run(*args, **kwargs), False
        except ForwardStopped as exc:
            if exc.stop is not self:
                raise
            return None, True


def builds_kv_cache(model: nn.Module) -> bool:
    """Whether `model(...)` builds a key/value cache unless told `use_cache=False` (Hugging Face decoders
    do by default). A pass that stops early returns nothing, so that cache is pure waste: 2 x [batch,
    heads, pos, d_head] per layer run (what it adds to a stopped capture's peak memory: bench/HISTORY.md,
    Capture and hooks, "Core (issue 2)")."""
    return bool(
        getattr(getattr(model, "config", None), "use_cache", False)
    ) and "use_cache" in forward_parameters(type(model))


def no_cache(model: nn.Module) -> dict[str, Any]:
    """The keyword that keeps a stopped pass from building `model`'s key/value cache, where it builds one."""
    return {"use_cache": False} if builds_kv_cache(model) else {}
