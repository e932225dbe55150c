"""torch.compile as a policy: `off` (default), `blocks` (regional) or `full`.

    model = hs.compile_model(model, "blocks")      # or HOOKSCOPE_COMPILE=blocks
    hs.load(path, compile_policy="blocks")          # the same, at load time

The module is `compiling` (not `compile`, which would shadow the builtin); `hs.compile_model` is
its one public verb. Its compiler counters and cache helpers stay here, outside the top-level
surface: `from hookscope.compiling import compile_stats, reset_stats, save_cache, load_cache`.

off     nothing is compiled: instant start, plain Python stack traces.
blocks  the repeated blocks' `forward` goes through ONE torch.compile call, so the graph traced
        for block 0 serves every layer (one trace, one inductor compile, whatever the depth).
full    the root model's `forward` is compiled as one graph.

Why `forward` and not `Module.compile()`: `Module.compile()` compiles `_call_impl`, which runs the
module's own hooks, so they would be traced into the graph. Compiling `forward` leaves hooks on
the region's own module (a block's resid_pre / resid_post; the root under `full`) running
eagerly around the compiled graph, where a capture can stop the forward, read point names and
copy to the host without a graph break or a recompile per layer. Hooks on modules *inside* a
region are traced into its graph: `compile_model` sets `torch._dynamo.config.skip_nnmodule_hook_guards
= False` (process-wide) so that hooks attached after the first compiled call fire, at the cost
of one recompile per distinct set of hooks (cached, so the same capture again is free).

A layer on top of the core: this module imports hooks and capture, never the reverse. `compile_model`
registers a `_Compiled` as the model's layer (`arch.state_of(model).layer`), the one seam through
which the core asks it two things (`hooks.Layer`): keep an untraceable hook (a gradient hook) out
of the graph, which `hold_eager` does by running its region eagerly while the hook is attached;
and take over a capture's points inside compiled regions, captured in two halves: the hook
traced into the graph only selects and copies (`_Deferred`); the region's own forward hook, which
runs eagerly, files the copy by name, moves it to its device and stops the pass. So the graph has
no break, and one graph serves every layer. `region_of` says which side of the line a point is on.
"""

from __future__ import annotations

import inspect
import os
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .arch import PointSpec, state_of
from .atomic_files import write_atomic
from .capture import Capture
from .errors import HookscopeError
from .hooks import Held, Hook, hold

if TYPE_CHECKING:
    from torch import Tensor

    from .arch import Arch

POLICIES = ("off", "blocks", "full")
ENV_VAR = "HOOKSCOPE_COMPILE"
# Every distinct set of hooks inside a region is one more compiled graph of the same code;
# torch's default of 8 would silently send the 9th back to eager.
RECOMPILE_LIMIT = 64
# inductor modes that replay CUDA graphs: their outputs live in a pool that the next call reuses
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


def resolve_policy(policy: str | None = None) -> str:
    """The policy to use: the argument if given, else $HOOKSCOPE_COMPILE, else "off"."""
    source = "policy"
    if policy is None:
        policy, source = os.environ.get(ENV_VAR) or "off", ENV_VAR
    value = policy.strip().lower()
    if value not in POLICIES:
        raise HookscopeError(f"{source}={policy!r} is not a compile policy: use one of {', '.join(POLICIES)}")
    return value


@dataclass
class _Region:
    module: nn.Module
    compiled: Callable  # the compiled forward, bound to `module`
    instance_forward: Any  # what module.__dict__["forward"] held before (None: the class's)


@dataclass
class _Compiled:
    """A compiled model's policy and regions; registered as its layer (see `hooks.Layer`)."""

    policy: str
    mode: str | None
    regions: dict[str, _Region] = field(default_factory=dict)

    def region_of(self, module_path: str) -> str | None:
        for region in self.regions:
            if region == "" and module_path != "":
                return region
            if region and module_path.startswith(region + "."):
                return region
        return None

    # the seam -------------------------------------------------------------------------------

    def untraceable(self, model: nn.Module, spec: PointSpec, reason: str) -> Held | None:
        region = self.region_of(spec.module)
        return None if region is None else hold_eager(model, region, reason)

    def split_capture(self, capture: Capture, specs: list[PointSpec]) -> list[PointSpec]:
        """Points inside a region: a traced hook keeps the static part of the selection (and a
        copy); the region's own forward hook, eager, does the rest and files it."""
        first, rest = capture.selection.split()
        # still the graph's output after a full in-graph selection: under CUDA graphs the next
        # replay overwrites it, so the eager half copies it
        copy = self.mode in CUDAGRAPH_MODES
        plain: list[PointSpec] = []
        regions: dict[str, list[_Deferred]] = {}
        for spec in specs:
            region = self.region_of(spec.module)
            if region is None:
                plain.append(spec)
                continue
            deferred = _Deferred(first, spec)
            capture.hooks.forward(spec, deferred)
            regions.setdefault(region, []).append(deferred)

        def flush(deferred: list[_Deferred]) -> None:
            for d in deferred:
                if d.value is not None:
                    kept, d.value = d.value, None
                    capture.file(d.spec.name, capture.take(kept, d.spec, selection=rest, copy=copy))

        for region, deferred in regions.items():
            capture.hooks.module_forward(
                PointSpec(name=f"<compiled {region or 'model'}>", module=region, io="output"),
                lambda module, args, output, d=deferred: flush(d),
            )
        return plain


class _Deferred:
    """The traced hook of a point inside a compiled region: it keeps the selected copy in `value`
    and nothing else. No name, no host copy, no raise: those would break the graph, and the
    per-layer name would make each layer a graph of its own."""

    __slots__ = ("selection", "spec", "value")

    def __init__(self, selection: Any, spec: PointSpec):
        self.selection, self.spec, self.value = selection, spec, None

    def __call__(self, act: Tensor, hook: Hook) -> None:
        self.value = self.selection.take(act, self.spec)


def _compiled(model: nn.Module) -> _Compiled | None:
    layer = state_of(model).layer
    return layer if isinstance(layer, _Compiled) else None


def _recompile_limit() -> dict:
    """torch.compile's own option where it has one (torch >= 2.13); older releases (2.11 on the GPU
    machines) only read dynamo's global setting, so raise that instead (never lower it)."""
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return {"recompile_limit": RECOMPILE_LIMIT}
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
    return {}


def compile_model(
    model: nn.Module,
    policy: str | None = None,
    *,
    mode: str | None = None,
    dynamic: bool | None = None,
    fullgraph: bool = False,
    backend: str | Callable | None = None,
    arch: Arch | None = None,
) -> nn.Module:
    """Compile `model` in place under `policy` (see `resolve_policy`) and return it.

    `mode`, `dynamic` and `fullgraph` go to `torch.compile`; `backend` too (default inductor;
    "eager" traces without generating code, handy for checking graph breaks quickly).
    "off" returns the model untouched and never calls torch.compile.

    Returns:
        nn.Module: the same model, compiled in place (captures and edits keep working on it).

    Raises:
        HookscopeError: an unknown policy, or "blocks" on a model without repeated blocks."""
    policy = resolve_policy(policy)
    if policy == "off":
        return model
    done = _compiled(model)
    if done is not None:
        if done.policy == policy:
            return model
        raise HookscopeError(
            f"this model is already compiled with policy {done.policy!r}; load it again to use {policy!r}"
        )
    targets = _blocks(model, arch) if policy == "blocks" else {"": model}
    # hooks attached after the first compiled call must fire (pytorch #117758)
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    options = {
        "mode": mode,
        "dynamic": dynamic,
        "fullgraph": fullgraph,
        "backend": backend or "inductor",
        **_recompile_limit(),
    }
    state = _Compiled(policy, mode)
    shared: dict[Callable, Callable] = {}  # one torch.compile call per distinct forward function
    for path, module in targets.items():
        instance_forward = module.__dict__.get("forward")
        function = _class_forward(module)
        if function is not None:
            if function not in shared:
                shared[function] = torch.compile(function, **options)
            compiled = types.MethodType(shared[function], module)
        else:  # a per-instance forward (e.g. accelerate's wrapper): compile it on its own
            compiled = torch.compile(module.forward, **options)
        module.forward = compiled
        state.regions[path] = _Region(module, compiled, instance_forward)
    state_of(model).layer = state
    return model


def _blocks(model: nn.Module, arch: Arch | None) -> dict[str, nn.Module]:
    from .arch import arch_of  # only here: the policy itself needs no model tables

    paths = (arch or arch_of(model)).block_paths
    if not paths:
        raise HookscopeError("policy 'blocks' found no repeated blocks in this model; use 'full' (or 'off')")
    # A KV cache built during a plain forward is wasted work, and its per-layer state
    # (layers[i].is_initialized) would make every layer a separate compiled graph.
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False
    return {path: model.get_submodule(path) for path in paths}


def _class_forward(module: nn.Module) -> Callable | None:
    forward = module.forward
    if isinstance(forward, types.MethodType) and forward.__self__ is module:
        return forward.__func__
    return None


def policy_of(model: nn.Module) -> str:
    """The policy `compile_model` compiled this model with ("off" if it did not)."""
    state = _compiled(model)
    return state.policy if state is not None else "off"


def region_of(model: nn.Module, module_path: str) -> str | None:
    """The compiled region whose graph runs the hooks of the module at `module_path`, or None
    when they run eagerly (not compiled, or on the region's own module)."""
    state = _compiled(model)
    return None if state is None else state.region_of(module_path)


def _set_forward(module: nn.Module, forward: Any) -> None:
    if forward is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = forward


def hold_eager(model: nn.Module, region: str, reason: str) -> Held:
    """Run `region` eagerly until the returned handle is removed; warns once per reason."""
    warn_once(
        f"{reason}; hookscope runs {'the whole model' if region == '' else 'that block'} "
        "eagerly while it is attached (policy blocks / full)"
    )
    state = _compiled(model)
    if state is None or region not in state.regions:
        raise HookscopeError(f"no compiled region {region!r} in this model")
    target = state.regions[region]

    def switch() -> Callable[[], None]:
        _set_forward(target.module, target.instance_forward)
        return lambda: setattr(target.module, "forward", target.compiled)

    return hold(model, ("eager region", region), switch)


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


# --- what the compiler did -----------------------------------------------------------------


def compile_stats() -> dict[str, Any]:
    """Graph breaks, recompiles and graphs since the process started (or `reset_stats()`),
    from torch._dynamo's own counters; for `hookscope profile` and tests."""
    from torch._dynamo.utils import counters, get_compilation_metrics

    metrics = get_compilation_metrics()
    recompiles = [m.recompile_reason for m in metrics if m.recompile_reason]
    frames = counters["frames"]
    return {
        "graph_breaks": sum(counters["graph_break"].values()),
        "break_reasons": dict(counters["graph_break"]),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "frames_compiled": frames["ok"],
        # frames dynamo tried and gave up on (they ran eagerly)
        "frames_failed": frames["total"] - frames["ok"],
        "recompiles": len(recompiles),
        "recompile_reasons": [r.splitlines()[0] for r in recompiles],
        "compile_time_s": sum(m.entire_frame_compile_time_s or 0.0 for m in metrics),
    }


def reset_stats() -> None:
    """Zero the counters `compile_stats` reads (compiled code is kept)."""
    from torch._dynamo.utils import clear_compilation_metrics, counters

    counters.clear()
    clear_compilation_metrics()


# --- compile caches --------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where inductor keeps compiled graphs across processes ($TORCHINDUCTOR_CACHE_DIR)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    return Path(inductor_cache_dir())


def save_cache(path: str | Path) -> Path | None:
    """Write every compile artifact of this process to one file (torch's "mega-cache"), for a
    machine or container whose cache directory starts empty. Returns None if there is nothing."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, saved[0])
    return path


def load_cache(path: str | Path) -> bool:
    """Preload the artifacts `save_cache` wrote; call before the first compiled forward."""
    path = Path(path)
    if not path.is_file():
        raise HookscopeError(f"no compile cache at {path}; write one with hookscope.compiling.save_cache")
    return torch.compiler.load_cache_artifacts(path.read_bytes()) is not None
