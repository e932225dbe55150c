"""torch.compile as a policy: `off` (default), `blocks` (regional) or `full`.

    model = hs.compile.apply(model, "blocks")      # or HOOKSCOPE_COMPILE=blocks

off     nothing is compiled: instant start, plain Python stack traces.
blocks  the repeated blocks' `forward` goes through ONE torch.compile call, so the graph traced
        for block 0 serves every layer (one trace, one inductor compile, whatever the depth).
full    the root model's `forward` is compiled as one graph.

Why `forward` and not `Module.compile()`: `Module.compile()` compiles `_call_impl`, which runs the
module's own hooks, so they would be traced into the graph. Compiling `forward` leaves hooks on
the region's own module (a block's resid_pre / resid_post; the root under `full`) running
eagerly around the compiled graph, where a capture can stop the forward, read point names and
copy to the host without a graph break or a recompile per layer. Hooks on modules *inside* a
region are traced into its graph: `apply` sets `torch._dynamo.config.skip_nnmodule_hook_guards
= False` (process-wide) so that hooks attached after the first compiled call fire, at the cost
of one recompile per distinct set of hooks (cached, so the same capture again is free).
`region_of` tells the hook machinery which side of that line a point is on, and `hold_eager`
runs a region eagerly while a hook that dynamo cannot compile (a gradient hook) is attached.
"""

from __future__ import annotations

import os
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .errors import HookscopeError

if TYPE_CHECKING:
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
    holds: int = 0


@dataclass
class _Compiled:
    policy: str
    mode: str | None
    regions: dict[str, _Region] = field(default_factory=dict)


_STATE: weakref.WeakKeyDictionary[nn.Module, _Compiled] = weakref.WeakKeyDictionary()


def apply(
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
    """
    policy = resolve_policy(policy)
    if policy == "off":
        return model
    done = _STATE.get(model)
    if done is not None:
        if done.policy == policy:
            return model
        raise HookscopeError(
            f"this model is already compiled with policy {done.policy!r}; load it again to use {policy!r}"
        )
    targets = _blocks(model, arch) if policy == "blocks" else {"": model}
    # hooks attached after the first compiled call must fire (pytorch #117758)
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    options = {"mode": mode, "dynamic": dynamic, "fullgraph": fullgraph, "backend": backend or "inductor",
               "recompile_limit": RECOMPILE_LIMIT}
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
    _STATE[model] = state
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
    """The policy `apply` compiled this model with ("off" if it did not)."""
    state = _STATE.get(model)
    return state.policy if state is not None else "off"


def region_of(model: nn.Module, module_path: str) -> str | None:
    """The compiled region whose graph runs the hooks of the module at `module_path`, or None
    when they run eagerly (not compiled, or on the region's own module)."""
    state = _STATE.get(model)
    if state is None:
        return None
    for region in state.regions:
        if region == "" and module_path != "":
            return region
        if region and module_path.startswith(region + "."):
            return region
    return None


def clones_outputs(model: nn.Module) -> bool:
    """Whether the model's compiled outputs are CUDA-graph buffers that the next call overwrites."""
    state = _STATE.get(model)
    return state is not None and state.mode in CUDAGRAPH_MODES


class _EagerHold:
    """While held, a region runs its original (eager) forward. Acts as a hook handle."""

    def __init__(self, region: _Region):
        self.region = region
        region.holds += 1
        if region.holds == 1:
            _set_forward(region.module, region.instance_forward)
        self._released = False

    def remove(self) -> None:
        if self._released:
            return
        self._released = True
        self.region.holds -= 1
        if self.region.holds == 0:
            self.region.module.forward = self.region.compiled


def _set_forward(module: nn.Module, forward: Any) -> None:
    if forward is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = forward


def hold_eager(model: nn.Module, region: str, reason: str) -> _EagerHold:
    """Run `region` eagerly until the returned handle is removed; warns once per reason."""
    warn_once(f"{reason}; hookscope runs {'the whole model' if region == '' else 'that block'} "
              "eagerly while it is attached (policy blocks / full)")
    return _EagerHold(_STATE[model].regions[region])


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
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(saved[0])
    tmp.replace(path)
    return path


def load_cache(path: str | Path) -> bool:
    """Preload the artifacts `save_cache` wrote; call before the first compiled forward."""
    path = Path(path)
    if not path.is_file():
        raise HookscopeError(f"no compile cache at {path}; write one with hookscope.compile.save_cache")
    return torch.compiler.load_cache_artifacts(path.read_bytes()) is not None
