"""Capture activations: only the points, positions and heads asked for, in the dtype and on the
device asked for, and stop the forward pass right after the last needed point has run.

    acts = hs.collect(model, ids, ["blocks.5.resid_post"])      # runs the model, stops after block 5

    with hs.capture(model, "blocks.*.resid_post", positions="last") as cap:
        logits = model(ids)                                         # full pass; no stop
    cap["blocks.3.resid_post"]

Early stop raises a private exception from the hook of the last point; it is caught by
`Capture.run` / `collect`, which therefore never see layers after it run. A point that never ran
is an error when read, never a silent gap.

Under a compile policy (`hookscope.compile`), a point inside a compiled region is captured in two
halves: the hook traced into the graph only selects and copies (`_Deferred`); the region's own
forward hook, which runs eagerly, files the copy by name, moves it to its device and stops the
pass. So the graph has no break, and one graph serves every layer.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .arch import Arch, PointSpec, arch_of
from .compile import clones_outputs, region_of
from .errors import PointNotReachedError, SelectionError
from .hooks import Hook, Hooks, call_model, require_writable
from .selection import Heads, Positions, select_heads, select_positions, select_tokens


class _StopForward(BaseException):
    """Raised after the last needed point. BaseException so that model code that catches
    `Exception` cannot swallow it."""


def _builds_kv_cache(model: nn.Module) -> bool:
    """Whether `model(...)` builds a key/value cache unless told `use_cache=False` (Hugging Face
    decoders do by default). A pass that stops early returns nothing, so that cache is pure
    waste: 2 x [batch, heads, pos, d_head] per layer run, +58% peak memory capturing block 5 of
    a GPT-2-small shape at 8 x 128."""
    return bool(getattr(getattr(model, "config", None), "use_cache", False)) and _takes_use_cache(type(model))


@functools.cache
def _takes_use_cache(cls: type) -> bool:
    return "use_cache" in inspect.signature(cls.forward).parameters


class _Deferred:
    """The traced hook of a point inside a compiled region: it keeps the selected copy in `value`
    and nothing else. No name, no host copy, no raise: those would break the graph, and the
    per-layer name would make each layer a graph of its own. `Capture._flush` does the rest."""

    __slots__ = ("capture", "spec", "value")

    def __init__(self, capture: Capture, spec: PointSpec):
        self.capture, self.spec, self.value = capture, spec, None

    def __call__(self, act: Tensor, hook: Hook) -> None:
        self.value = self.capture._take(act, self.spec)


class Capture(Mapping[str, Tensor]):
    """Hooks that keep copies of chosen activations. Use as a `with` block; read like a dict."""

    def __init__(
        self,
        model: nn.Module,
        points: str | Sequence[str],
        *,
        positions: Positions = None,
        heads: Heads = None,
        token_mask: Tensor | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        stop: bool | None = None,
        inference: bool = True,
        accumulate: bool = False,
        arch: Arch | None = None,
    ):
        if token_mask is not None and positions is not None:
            raise SelectionError("give either positions= or token_mask=, not both")
        self.model = model
        self.arch = arch or arch_of(model)
        self.specs: list[PointSpec] = self.arch.resolve(points)
        self.positions, self.heads, self.token_mask = positions, heads, token_mask
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else None
        self.stop = stop  # None: stop only inside run() / collect(), where nobody sees the cut
        self.inference, self.accumulate = inference, accumulate
        self._hooks = Hooks(model, self.arch)
        self._store: dict[str, list[Tensor]] = {}
        self._pending: set[str] = set()
        self._stop_now = False
        self._events: list = []
        self._mode: contextlib.ExitStack | None = None
        self._deferred: list[_Deferred] = []

    # lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> Capture:
        self._mode = contextlib.ExitStack()
        if self.inference:
            self._mode.enter_context(torch.inference_mode())
        try:
            regions: dict[str, list[_Deferred]] = {}
            for spec in self.specs:
                region = region_of(self.model, spec.module)
                if region is None:
                    self._hooks.forward(spec, self._keep)
                else:
                    deferred = _Deferred(self, spec)
                    self._hooks.forward(spec, deferred)
                    regions.setdefault(region, []).append(deferred)
            for region, deferred in regions.items():
                self._deferred += deferred
                self._hooks.module_forward(
                    PointSpec(name=f"<compiled {region or 'model'}>", module=region, io="output"),
                    lambda module, args, output, d=deferred: self._flush(d))
            # a new forward pass starts: every point is pending again
            self._hooks.module_pre_forward(PointSpec(name="<root>", module="", io="input"),
                                           lambda module, args, kwargs: self._start_pass())
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._close()
        return exc_type is _StopForward  # a user-requested stop=True ends the `with` body quietly

    def _close(self) -> None:
        self._hooks.remove()
        if self._mode is not None:
            self._mode.close()
            self._mode = None
        self._sync()

    def run(self, inputs: Any) -> Any:
        """Run the model on `inputs`, stopping after the last point unless stop=False.
        Returns the model output, or None when the pass was stopped early. Unless stop=False, a
        Hugging Face decoder runs without building its key/value cache (see `_builds_kv_cache`)."""
        self._stop_now = self.stop is not False
        options = {"use_cache": False} if self._stop_now and _builds_kv_cache(self.model) else {}
        try:
            output = call_model(self.model, inputs, **options)
        except _StopForward:
            output = None
        finally:
            self._stop_now = bool(self.stop)
        # only after a pass that ended normally: an error raised mid-pass must reach the caller
        self._check_all_ran()
        return output

    # hooks ---------------------------------------------------------------------------------

    def _start_pass(self) -> None:
        self._pending = {s.name for s in self.specs}
        for deferred in self._deferred:
            deferred.value = None
        if self.stop is True:
            self._stop_now = True

    def _keep(self, act: Tensor, hook: Hook) -> None:
        self._file(hook.spec.name, self._select(act, hook.spec))

    def _flush(self, deferred: list[_Deferred]) -> None:
        """After a compiled region returned (eagerly): file what its traced hooks kept."""
        for d in deferred:
            if d.value is not None:
                kept, d.value = d.value, None
                self._file(d.spec.name, self._finish(kept, d.spec))

    def _file(self, name: str, kept: Tensor) -> None:
        if self.accumulate:
            self._store.setdefault(name, []).append(kept)
        else:
            self._store[name] = [kept]
        self._pending.discard(name)
        if self._stop_now and not self._pending:
            raise _StopForward

    def _select(self, act: Tensor, spec: PointSpec) -> Tensor:
        x = select_heads(act, self.heads, spec.head_dim)
        if self.token_mask is not None:
            x = select_tokens(x, self.token_mask, spec.pos_dim)
        else:
            x = select_positions(x, self.positions, spec.pos_dim)
        # compare storages: views made under inference_mode have no _base, and a view at an
        # offset (positions=1) has a different data_ptr
        shares_memory = x.untyped_storage().data_ptr() == act.untyped_storage().data_ptr()
        # integer points (router indices, expert token indices) keep their dtype: a float cast
        # would silently round indices above 256 in bfloat16
        if self.dtype is not None and x.dtype != self.dtype and x.is_floating_point():
            x = x.to(self.dtype)  # cast on the device, before the copy: fewer bytes to move
            shares_memory = False
        if self.device is not None and x.device != self.device:
            x = self._to_device(x)
        elif shares_memory:
            # never keep a view of the live activation: a later in-place op would rewrite it
            x = x.clone()
        return x

    def _in_graph(self) -> tuple[bool, bool]:
        """Which selections a compiled graph can make: those given as Python values (a tensor
        selection is data; a token mask gives a data-dependent shape). Heads go first."""
        heads = not isinstance(self.heads, Tensor)
        return heads, heads and self.token_mask is None and not isinstance(self.positions, Tensor)

    def _take(self, act: Tensor, spec: PointSpec) -> Tensor:
        """The traced half: static selections, the cast, and always a copy (the activation lives on
        inside the graph)."""
        heads, positions = self._in_graph()
        x = select_heads(act, self.heads, spec.head_dim) if heads else act
        if positions:
            x = select_positions(x, self.positions, spec.pos_dim)
        cast = self.dtype is not None and x.dtype != self.dtype and x.is_floating_point()
        return x.to(self.dtype) if cast else x.clone()

    def _finish(self, x: Tensor, spec: PointSpec) -> Tensor:
        """The eager half, after the region returned: the other selections and the device."""
        heads, positions = self._in_graph()
        if not heads:
            x = select_heads(x, self.heads, spec.head_dim)
        if not positions:
            x = select_tokens(x, self.token_mask, spec.pos_dim) if self.token_mask is not None \
                else select_positions(x, self.positions, spec.pos_dim)
        if self.device is not None and x.device != self.device:
            return self._to_device(x)
        if heads and positions and clones_outputs(self.model):
            x = x.clone()  # still the graph's output: under CUDA graphs the next replay overwrites it
        return x

    def _to_device(self, x: Tensor) -> Tensor:
        if x.is_cuda and self.device.type == "cpu":
            # pinned host buffer + non-blocking copy; synchronised before anyone reads it
            buf = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            buf.copy_(x, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._events.append(event)
            return buf
        return x.to(self.device, non_blocking=True, copy=True)

    def _sync(self) -> None:
        for event in self._events:
            event.synchronize()
        self._events.clear()

    def _check_all_ran(self) -> None:
        if self._pending:
            missing = sorted(self._pending)
            self._pending = set()
            raise PointNotReachedError(
                f"point(s) {', '.join(missing)} never ran in this forward pass; check the model's "
                "execution path (e.g. an encoder-only model has no logits)"
            )

    # reading -------------------------------------------------------------------------------

    def __getitem__(self, name: str) -> Tensor:
        key = self._key(name)
        self._sync()
        parts = self._store.get(key)
        if not parts:
            raise PointNotReachedError(f"point {key!r} has not run since the capture started")
        return parts[-1] if len(parts) == 1 else torch.cat(parts, dim=0)

    def _key(self, name: str) -> str:
        if name in self._store:
            return name
        spec = self.arch.spec(name)
        if spec.name not in {s.name for s in self.specs}:
            raise KeyError(f"{spec.name!r} is not one of the captured points: {[s.name for s in self.specs]}")
        return spec.name

    def __iter__(self) -> Iterator[str]:
        return iter([s.name for s in self.specs if s.name in self._store])

    def __len__(self) -> int:
        return sum(1 for s in self.specs if s.name in self._store)


def capture(model: nn.Module, points: str | Sequence[str], **options: Any) -> Capture:
    """Hooks that keep copies of `points` while the `with` block runs; see `Capture`."""
    return Capture(model, points, **options)


def collect(model: nn.Module, inputs: Any, points: str | Sequence[str], **options: Any) -> dict[str, Tensor]:
    """Run the model on `inputs` and return `{point: activation}`; no layer after the last
    needed point runs."""
    with Capture(model, points, **options) as cap:
        cap.run(inputs)
    return {name: cap[name] for name in cap}


def grads(
    model: nn.Module,
    inputs: Any,
    points: str | Sequence[str],
    loss_fn,
    *,
    arch: Arch | None = None,
) -> dict[str, Tensor]:
    """d loss / d activation at each point, where `loss = loss_fn(model_output)` is a scalar."""
    arch = arch or arch_of(model)
    specs = arch.resolve(points)
    for spec in specs:
        require_writable(spec, "a gradient")
    kept: dict[str, Tensor] = {}

    def keep(act: Tensor, hook: Hook) -> Tensor:
        if not act.requires_grad:
            act = act.detach().requires_grad_()
        kept[hook.spec.name] = act
        return act  # written back (through the view), so everything downstream depends on it

    with Hooks(model, arch) as h, torch.enable_grad():
        for spec in specs:
            # autograd cannot differentiate with respect to a tensor a compiled graph only returned
            h.forward(spec, keep, eager="a gradient with respect to a point inside a compiled region")
        output = call_model(model, inputs)
    missing = [s.name for s in specs if s.name not in kept]
    if missing:
        raise PointNotReachedError(f"point(s) {', '.join(missing)} never ran in the forward pass")
    loss = loss_fn(output)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise SelectionError("loss_fn must return a scalar tensor")
    values = torch.autograd.grad(loss, [kept[s.name] for s in specs], allow_unused=True)
    return {s.name: (g if g is not None else torch.zeros_like(kept[s.name]))
            for s, g in zip(specs, values, strict=True)}


@dataclass(frozen=True)
class PointInfo:
    name: str
    module: str
    io: str
    view: str
    shape: tuple[int, ...] | None = None


def points(model: nn.Module, example: Any = None, *, pattern: str | None = None) -> list[PointInfo]:
    """The model's hook points in execution order; with an example input, their shapes too
    (measured by one forward pass under inference_mode)."""
    arch = arch_of(model)
    specs = arch.resolve(pattern) if pattern else list(arch.specs.values())
    shapes: dict[str, tuple[int, ...]] = {}
    if example is not None:
        def record(act: Tensor, hook: Hook) -> None:
            shapes[hook.spec.name] = tuple(act.shape)

        # a one-off pass: compiling a graph per hooked layer for it would cost far more
        with Hooks(model, arch) as h, torch.inference_mode(), torch.compiler.set_stance("force_eager"):
            for spec in specs:
                h.forward(spec, record)
            call_model(model, example)
    return [
        PointInfo(s.name, s.module or "<root>", s.io, s.view.label if s.view else "", shapes.get(s.name))
        for s in specs
    ]
