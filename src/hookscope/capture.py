"""Capture activations: only the points, positions and heads asked for, in the dtype and on the
device asked for, and stop the forward pass right after the last needed point has run.

    acts = hs.collect(model, ids, ["blocks.5.resid_post"])      # runs the model, stops after block 5

    with hs.capture(model, "blocks.*.resid_post", positions="last") as cap:
        logits = model(ids)                                         # full pass; no stop
    cap["blocks.3.resid_post"]

Which one stops early: `collect` (and `Capture.run`) stop after the last needed point unless told
`stop=False`; a `with hs.capture(...)` block runs the whole model unless told `stop=True`.

Early stop raises a private exception from the hook of the last point; it is caught by
`Capture.run` / `collect` (or, with stop=True, by the `with` block), which therefore never see
layers after it run. A point that never ran is an error when read, never a silent gap.

Keys: what you get back answers to the names you asked for. A plain name is a key as you wrote
it (`blocks.0.hook_resid_post` stays `blocks.0.hook_resid_post`), a pattern gives one key per
point it matched, in canonical spelling; any other spelling of a captured point reads it too.

There is one path: a hook per point keeps `selection.take(act)`. Under a compile policy, the
compile layer takes over the points inside compiled regions through one seam
(`hooks.Layer.split_capture`); this module never imports it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from .arch import Arch, PointSpec, arch_of, state_of
from .atomic_files import write_atomic
from .errors import HookscopeError, PointNotReachedError, SelectionError
from .hooks import Hook, Hooks, grad_leaf
from .model_inputs import attention_mask_of, call_model
from .names import canonical, find_key, is_pattern, meaning
from .selection import Heads, Positions, Selection
from .stopping import Stop, no_cache


def keyed_specs(arch: Arch, points: str | Sequence[str]) -> dict[str, PointSpec]:
    """{key: spec} for names and patterns: a plain name keeps the spelling it was asked by, a
    pattern gives one canonical key per point it matched. A point asked twice is kept once,
    under its first key."""
    if isinstance(points, str):
        spec = arch.specs.get(points)
        if spec is not None:  # one point by its canonical name: the common case, in one lookup
            return {points: spec}
        points = [p for p in points.split(",") if p.strip()] if "," in points else [points]
    out: dict[str, PointSpec] = {}
    seen: set[str] = set()
    for raw in points:
        name = raw.strip()
        if is_pattern(canonical(name)):
            pairs = [(s.name, s) for s in arch.resolve(name)]
        else:
            pairs = [(name, arch.spec(name))]
        for key, spec in pairs:
            if spec.name not in seen:
                seen.add(spec.name)
                out[key] = spec
    return out


class PointDict(dict):
    """A dict of point -> tensor, keyed by the names asked for, that also answers to any other
    spelling of the same points (`blocks.0.resid_post` and `blocks.0.hook_resid_post`). Other
    spellings are resolved by the model's own table when it is known (a TransformerLens 4 bridge
    has aliases that `names.canonical` cannot fold), else by `names.canonical`."""

    def __init__(self, items: Any = (), *, arch: Arch | None = None):
        super().__init__(items)
        self._arch = arch

    def _point(self, key: str) -> str | None:
        if self._arch is None:
            return canonical(key)
        try:
            return self._arch.spec(key).name
        except (KeyError, HookscopeError):
            return None

    def _alias(self, key: Any) -> Any:
        return find_key(self, key, self._point) if isinstance(key, str) else None

    def __missing__(self, key: Any) -> Tensor:
        alias = self._alias(key)
        if alias is None:
            raise KeyError(key)
        return dict.__getitem__(self, alias)

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) or self._alias(key) is not None

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default


class Kept(Mapping[str, Tensor]):
    """What a capture kept, read like a dict: keyed by the names asked for, and any other spelling
    of a captured point reads it too. With `accumulate`, each pass adds a part (`Capture.file`); a
    read concatenates them along the batch dim."""

    def __init__(self, arch: Arch, keys: dict[str, PointSpec], accumulate: bool):
        self.arch, self._keys, self.accumulate = arch, keys, accumulate
        self._key_of: dict[str, str] = {}  # canonical name -> key; a loop: a comprehension is a call
        for key, spec in keys.items():
            self._key_of[spec.name] = key
        self._parts: dict[str, list[Tensor]] = {}  # canonical name -> parts (one per pass)
        self.events: list = []  # CUDA events of non-blocking host copies: waited for before a read

    def sync(self) -> None:
        for event in self.events:
            event.synchronize()
        self.events.clear()

    def __getitem__(self, name: str) -> Tensor:
        spec = self._keys.get(name) or self.arch.spec(name)
        if spec.name not in self._key_of:
            raise KeyError(f"{spec.name!r} is not one of the captured points: {list(self._keys)}")
        if self.events:
            self.sync()
        parts = self._parts.get(spec.name)
        if not parts:
            raise PointNotReachedError(f"point {name!r} has not run since the capture started")
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def __iter__(self) -> Iterator[str]:
        return iter([key for key, spec in self._keys.items() if spec.name in self._parts])

    def __len__(self) -> int:
        return sum(1 for name in self._key_of if name in self._parts)

    def __contains__(self, name: object) -> bool:
        try:
            self[name]  # type: ignore[index]
        except (KeyError, PointNotReachedError):
            return False
        return True


class Capture(Kept):
    """Hooks that keep copies of chosen activations. Use as a `with` block; read like a dict.

    Built by `hs.capture(model, points, ...)`; the model runs whole inside the block unless
    `stop=True`. `attention_mask`: the batch's mask, for `positions="last"` (each row's last real
    token); when left out, the `attention_mask=` the model is called with is used.

    What a hook keeps goes through one method, `take`: a subclass that keeps rows elsewhere (the
    extraction writes them into its own reused buffers, extract/lending.py) overrides it alone.

    Raises:
        UnknownPointError: a point name the model does not have (the message lists close names).
        SelectionError: positions, heads or a token mask that do not fit the point.
        PointNotReachedError: reading a point that never ran while the block was open."""

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
        attention_mask: Tensor | None = None,
        arch: Arch | None = None,
    ):
        self._state = state_of(model)  # its `layer` is asked at enter
        if arch is None:
            arch = self._state.arch if self._state.arch is not None else arch_of(model)
        super().__init__(arch, keyed_specs(arch, points), accumulate)
        self.model, self.inference, self.attention_mask = model, inference, attention_mask
        self.selection = Selection.of(positions, heads, token_mask, dtype, device)
        self._rows_apart = self.selection.rows_apart()  # for views that cost per row (`_keep_rows`)
        self.specs: list[PointSpec] = list(self._keys.values())
        self.stop = stop  # True: the `with` block's passes stop too; False: not even `run`'s
        self._stopper = Stop()  # what ends this capture's passes, and only theirs
        # what ends the pass running now once its last point is kept (None: it runs whole):
        # a `with` block's passes run whole unless stop=True; `run` sets its own for its pass
        self._pass_stop: Stop | None = self._stopper if stop is True else None
        self.hooks = Hooks(model, arch)
        # whether each pass's own attention mask is read (for "last", when none was given)
        self._mask_per_pass = attention_mask is None and self.selection.wants_attention_mask
        self._pending: set[str] = set()
        self.pass_mask: Tensor | None = None  # the attention mask of the pass running now
        self._mode: Any = None  # the inference_mode context while the `with` block runs

    def __enter__(self) -> Capture:
        if self.inference and not torch.is_inference_mode_enabled():
            self._mode = torch._C._InferenceMode(True)  # inference_mode()'s context, minus its wrapper
            self._mode.__enter__()
        try:
            layer = self._state.layer
            for spec in self.specs if layer is None else layer.split_capture(self, self.specs):
                if self._rows_apart is not None and spec.view is not None and spec.view.select_rows_first:
                    self.hooks.forward(replace(spec, view=None), partial(self._keep_rows, spec))
                else:
                    self.hooks.forward(spec, self._keep)
            # a hook on the root only where a pass needs its own start: to stop it, or to read its mask
            if self.stop is True or self._mask_per_pass:
                self.hooks.pass_start(self._start_pass)
            self._pending, self.pass_mask = set(self._key_of), self.attention_mask  # _start_pass(None)
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._close()
        # a user-requested stop=True ends the `with` body quietly
        return exc is not None and self._stopper.ended(exc)

    def _close(self) -> None:
        self.hooks.remove()
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
        if self.events:
            self.sync()

    def run(self, inputs: Any) -> Any:
        """Run the model on `inputs`, stopping after the last point unless stop=False.
        Returns the model output, or None when the pass was stopped early. Unless stop=False, a
        Hugging Face decoder runs without building its key/value cache (see `stopping.builds_kv_cache`)."""
        outer, self._pass_stop = self._pass_stop, None if self.stop is False else self._stopper
        self._start_pass(attention_mask_of(inputs) if isinstance(inputs, Mapping) else None)
        options = no_cache(self.model) if self._pass_stop is not None else {}
        try:
            output, _ = self._stopper.run(self.model, inputs, **options)
        finally:
            self._pass_stop = outer
        if self._pending:  # only after a pass that ended normally: an error mid-pass must reach the caller
            missing, self._pending = ", ".join(sorted(self._pending)), set()
            raise PointNotReachedError(
                f"point(s) {missing} never ran in this forward pass; check the "
                "model's execution path (e.g. an encoder-only model has no logits)"
            )
        return output

    def _start_pass(self, mask: Tensor | None) -> None:
        """A pass starts, called with attention mask `mask` (or None)."""
        self._pending = set(self._key_of)
        self.pass_mask = mask if self._mask_per_pass else self.attention_mask

    def _keep(self, act: Tensor, hook: Hook) -> None:
        self.file(hook.spec.name, self.take(act, hook.spec))

    def _keep_rows(self, spec: PointSpec, raw: Tensor, hook: Hook) -> None:
        """`_keep` at a point whose view costs per row (a tensor-parallel gather): the positions or
        tokens picked from the raw tensor first, then the view on those rows alone, then the rest."""
        rows, rest = self._rows_apart
        picked = rows.select(raw, spec, attention_mask=self.pass_mask)
        # the dims the rows took out (a position, or batch and position made one) lie before the heads
        head_dim = spec.head_dim
        if head_dim is not None and head_dim >= 0:
            head_dim -= raw.ndim - picked.ndim
        after = replace(spec, pos_dim=None, head_dim=head_dim)
        self.file(spec.name, self.take(spec.view.get(picked), after, selection=rest, copy=False))

    def take(
        self, act: Tensor, spec: PointSpec, *, selection: Selection | None = None, copy: bool = True
    ) -> Tensor:
        """What is kept of `act` at point `spec`: the part `selection` (this capture's unless
        given: the eager half of a compiled point's) selects, cast, on the capture's device, never
        a view of `act` unless `copy=False`. A copy from a CUDA device to the host does not wait
        for the device: it is waited for before any read."""
        kept = (selection or self.selection).take(
            act, spec, attention_mask=self.pass_mask, copy=copy, non_blocking=True
        )
        if act.is_cuda and kept.device.type == "cpu":
            event = torch.cuda.Event()
            event.record()
            self.events.append(event)
        return kept

    def file(self, name: str, kept: Tensor) -> None:
        """Keep `kept` as this pass's value of point `name`; stop the pass if it was the last one
        pending (and stopping was asked for)."""
        if self.accumulate:
            self._parts.setdefault(name, []).append(kept)
        else:
            self._parts[name] = [kept]
        self._pending.discard(name)
        if self._pass_stop is not None and not self._pending:
            self._pass_stop.now()


def capture(
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
    attention_mask: Tensor | None = None,
    arch: Arch | None = None,
) -> Capture:
    """Hooks that keep copies of `points` while the `with` block runs; see `Capture`. The core of
    `hs.capture` (`hookscope.verbs.capture`, whose docstring says what each option means).

    Returns:
        Capture: a `with` block; inside it and after, `cap[point]` is the kept copy.

    Raises:
        UnknownPointError: a point name the model does not have.
        SelectionError: an option that does not fit (checked when it is built) or the activation."""
    return Capture(
        model,
        points,
        positions=positions,
        heads=heads,
        token_mask=token_mask,
        dtype=dtype,
        device=device,
        stop=stop,
        inference=inference,
        accumulate=accumulate,
        attention_mask=attention_mask,
        arch=arch,
    )


def collect(
    model: nn.Module,
    inputs: Any,
    points: str | Sequence[str],
    *,
    positions: Positions = None,
    heads: Heads = None,
    token_mask: Tensor | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    stop: bool = True,
    inference: bool = True,
    attention_mask: Tensor | None = None,
    arch: Arch | None = None,
) -> PointDict:
    """Run the model on `inputs` and return `{point: activation}`; no layer after the last
    needed point runs. The core of `hs.collect` (`hookscope.verbs.collect`, whose docstring says
    what each option means), for an `nn.Module`.

    Returns:
        PointDict: `{point: tensor}`, keyed by the names asked for (a glob: one key per point).

    Raises:
        UnknownPointError: a point name the model does not have (the message lists close names).
        SelectionError: positions, heads or a token mask that do not fit the point.
        PointNotReachedError: a point that never ran in the forward pass (an encoder's `logits`)."""
    options = dict(positions=positions, heads=heads, token_mask=token_mask, dtype=dtype, device=device)
    # stop=None: only `run`'s pass stops (no root hook to end a `with` block's passes)
    stops = None if stop else False
    with Capture(
        model, points, **options, stop=stops, inference=inference, attention_mask=attention_mask, arch=arch
    ) as cap:
        cap.run(inputs)
    return PointDict(((key, cap[key]) for key in cap), arch=cap.arch)


def grads(
    model: nn.Module,
    inputs: Any,
    points: str | Sequence[str],
    loss_fn,
    *,
    arch: Arch | None = None,
) -> PointDict:
    """d loss / d activation at each point, where `loss = loss_fn(model_output)` is a scalar.
    Keyed like `collect`: by the names asked for. The core of `hs.grads` (`hookscope.verbs.grads`,
    whose docstring says what each option means).

    Returns:
        PointDict: `{point: gradient}`, shaped like the activations (zeros where the loss ignores it).

    Raises:
        UnknownPointError: a point name the model does not have.
        PointNotReachedError: a point that never ran in the forward pass.
        SelectionError: `loss_fn` returned something other than a scalar tensor."""
    arch = arch or arch_of(model)
    if arch.loaded is not None:
        arch.loaded.require_output("hs.grads computes loss_fn(the model's output)")
    keys = keyed_specs(arch, points)
    for spec in keys.values():
        spec.require_writable("a gradient")
    kept: dict[str, Tensor] = {}

    def keep(act: Tensor, hook: Hook) -> Tensor:
        act = kept[hook.spec.name] = grad_leaf(act, hook)
        return act  # written back (through the view), so everything downstream depends on it

    with Hooks(model, arch) as h, torch.enable_grad():
        for spec in keys.values():
            # autograd cannot differentiate with respect to a tensor a compiled graph only returned
            h.untraceable_forward(
                spec, keep, reason="a gradient with respect to a point inside a compiled region"
            )
        output = call_model(model, inputs)
    missing = [s.name for s in keys.values() if s.name not in kept]
    if missing:
        raise PointNotReachedError(f"point(s) {', '.join(missing)} never ran in the forward pass")
    loss = loss_fn(output)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise SelectionError("loss_fn must return a scalar tensor")
    leaves = [kept[s.name] for s in keys.values()]
    values = torch.autograd.grad(loss, leaves, allow_unused=True)
    return PointDict(
        (
            (key, g if g is not None else torch.zeros_like(leaf))
            for key, g, leaf in zip(keys, values, leaves, strict=True)
        ),
        arch=arch,
    )


@dataclass(frozen=True)
class PointInfo:
    """One hook point of a model, as `hs.points` lists it.

    Attributes:
        name: the canonical name (`blocks.3.resid_post`).
        module: the path of the module it hooks, in the model's own module tree.
        io: which side of that module: `"input"` or `"output"`.
        view: how the activation is read from the module's tensor (a per-head split); "" for as is.
        shape: its shape on the example input `hs.points` was given, else None.
        meaning: what the name means (`names.MEANINGS`); "" for a family's own points."""

    name: str
    module: str
    io: str
    view: str
    shape: tuple[int, ...] | None = None
    meaning: str = ""


def points(model: nn.Module, example: Any = None, *, pattern: str | None = None) -> list[PointInfo]:
    """The model's hook points in execution order; with an example input, their shapes too
    (measured by one forward pass under inference_mode). On a model loaded with `points=`, the
    shapes of the points its weights reach (the pass stops there); the others have none.

    Returns:
        list[PointInfo]: one per point, in execution order.

    Raises:
        UnknownPointError: a pattern that matches no point of the model."""
    arch = arch_of(model)
    specs = arch.resolve(pattern) if pattern else list(arch.specs.values())
    shapes: dict[str, tuple[int, ...]] = {}
    measured = specs if arch.loaded is None else [s for s in specs if arch.loaded.reaches(s)]
    if example is not None and measured:
        pending = {s.name for s in measured}
        stop = Stop()

        def record(act: Tensor, hook: Hook) -> None:
            shapes[hook.spec.name] = tuple(act.shape)
            pending.discard(hook.spec.name)
            if arch.loaded is not None and not pending:
                stop.now()  # before the pass reaches the weights left on meta

        # a one-off pass: compiling a graph per hooked layer for it would cost far more
        with Hooks(model, arch) as h, torch.inference_mode(), torch.compiler.set_stance("force_eager"):
            for spec in measured:
                h.forward(spec, record)
            stop.run(model, example)
    return [
        PointInfo(
            s.name,
            s.module or "<root>",
            s.io,
            s.view.label if s.view else "",
            shapes.get(s.name),
            meaning(s.name),
        )
        for s in specs
    ]


def save_tensors(
    path: str | os.PathLike, tensors: Mapping[str, Tensor], *, metadata: dict[str, str] | None = None
) -> None:
    """Write captured tensors to a .safetensors file, whole or not at all, with the umask's mode
    (safetensors' own `save_file` makes it 0600)."""
    from safetensors import SafetensorError
    from safetensors.torch import save

    try:
        write_atomic(path, save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata))
    except (OSError, SafetensorError) as e:
        raise HookscopeError(f"cannot write the captures to {path}: {e}") from e
