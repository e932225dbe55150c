"""Tensor-parallel models (transformers' `tp_plan` / `DistributedConfig(tp_size=N)` under torchrun):
which points are sharded across the ranks, and their views gathered into the whole tensor.

transformers shards a model by a plan: module path (layer numbers as `*`) -> a style. A
column-parallel Linear's output and a row-parallel Linear's input are each rank's contiguous slice
of the last dim (q / k / v, gate / up, `mlp.post`, `attn.z`); the residual stream, the row-parallel
outputs after their all-reduce, the embedding and the logits are whole on every rank. Which is
which is read from the style objects the plan names (their input / output layouts), never from a
list per family. Attention weights (`attn.pattern`) hold the rank's heads when its q projection does.

The model's table (`arch_of`) is changed once, through `arch.TABLE_CHANGES`: a sharded point's view
all-gathers the ranks' slices before the family's own view (so `attn.z` splits into the real heads,
and a heads selection means global heads), and its `put` hands each rank its own slice of an edited
whole tensor. With autograd on, the gather's backward keeps the rank's slice and the slice's
backward gathers, so `hs.grads` at a sharded point is the whole gradient. A gathered view is marked
`select_rows_first`: a capture with positions or a token mask picks its rows from the rank's slice
before the gather, and only those rows cross the ranks. Whole points are left as they are: one
capture, no collective. `sharded(model)` is the table that keeps each rank's slice,
its label naming the slice: what `hs.collect` / `hs.capture` / `hs.grads` read the names in with
`gather=False` (`kept_shards`, called by verbs.py: the core below never imports an engine).
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..arch import TABLE_CHANGES, Arch, PointSpec, View, arch_of
from ..errors import TensorParallelError
from ..names import MODULE_PREFIX

__all__ = ["Shard", "is_tensor_parallel", "kept_shards", "layout", "plan", "sharded"]


@dataclass(frozen=True)
class Shard:
    """How a point's tensor is split over the tensor-parallel group: along `dim` of the module's raw
    tensor, `size` equal contiguous parts, this process holding part `rank` of `width`."""

    dim: int
    rank: int
    size: int
    width: int
    group: Any = dataclasses.field(compare=False, repr=False)

    @property
    def part(self) -> int:
        return self.width // self.size

    def local(self, whole: Tensor, dim: int | None = None) -> Tensor:
        """This rank's part of a whole tensor (along `dim`, else the raw tensor's split dim)."""
        dim = self.dim if dim is None else dim
        n = whole.shape[dim] // self.size
        return whole.narrow(dim, self.rank * n, n)

    def describe(self, units: int | None = None, unit: str = "heads") -> str:
        """This rank's slice in words: `heads 2-3 of 4` for a per-head view, else the columns."""
        if units:
            n = units // self.size
            if n == 1:
                return f"{unit.rstrip('s')} {self.rank} of {units}"
            return f"{unit} {self.rank * n}-{self.rank * n + n - 1} of {units}"
        return f"columns {self.rank * self.part}:{(self.rank + 1) * self.part} of {self.width}"


# -- what transformers did to the model ------------------------------------------------------------


def tp_size(model: nn.Module) -> int:
    return int(getattr(model, "_tp_size", None) or 1)


def is_tensor_parallel(model: nn.Module) -> bool:
    """Whether transformers sharded `model` over more than one rank (`tp_plan` / `tp_size`)."""
    return tp_size(model) > 1 and getattr(model, "_device_mesh", None) is not None


def _group(model: nn.Module) -> Any:
    manager = getattr(model, "_mesh_manager", None)
    mesh = manager.get_mesh("tp") if manager is not None else model._device_mesh["tp"]
    return mesh.get_group()


def plan(model: nn.Module) -> dict[str, str]:
    """Module path -> transformers' style name, for each module of `model` its plan names (the
    plan's `*` matching a layer number, as transformers matches it)."""
    rules = dict(getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {})
    out = {}
    for path, _ in model.named_modules():
        style = rules.get(re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), path))
        if style is not None:
            out[path] = style
    return out


def _sharded_side(style_name: str, io: str) -> bool | None:
    """Whether a module's input / output is each rank's slice of the last dim under a style: True,
    False (whole on every rank), or None (a style whose layout hookscope does not read)."""
    from torch.distributed.tensor import Shard as DShard
    from transformers.distributed import tensor_parallel as styles

    style = styles.ALL_PARALLEL_STYLES[style_name]
    kind = type(style)
    if kind is styles.ColwiseParallel:  # input replicated; output sharded unless gathered
        return io == "output" and isinstance(style.output_layouts, DShard)
    if kind is styles.RowwiseParallel and not isinstance(style.output_layouts, DShard):
        return io == "input" and isinstance(style.input_layouts, DShard)  # output all-reduced
    if kind in (
        styles.TensorParallelLayer,  # "replicate"
        styles.EmbeddingParallel,
        styles.ReplicatedWithGradAllReduce,
        styles.AllReduceParallel,
    ):
        return False
    return None


_UNREAD = object()  # a point on a module whose style hookscope does not read


class _Sides:
    """Which side of which module is split, read once per model: transformers' plan, the modules,
    this rank's place in the tensor-parallel group."""

    def __init__(self, model: nn.Module):
        self.styles, self.group = plan(model), _group(model)
        self.rank, self.size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.modules = dict(model.named_modules())

    def of(self, spec: PointSpec) -> Shard | object | None:
        """The point's Shard, _UNREAD, or None where it is whole on every rank."""
        style = self.styles.get(spec.module)
        if style is None:
            return None
        side = _sharded_side(style, spec.io)
        if side is None:
            return _UNREAD
        if not side:
            return None
        module = self.modules[spec.module]
        width = module.out_features if spec.io == "output" else module.in_features
        if width % self.size:
            raise TensorParallelError(
                f"{spec.name}: {spec.module} is split over {self.size} ranks but its width {width} is not a "
                f"multiple of {self.size}; load with a tp that divides {width}"
            )
        return Shard(-1, self.rank, self.size, width, self.group)


def _layouts(sides: _Sides, arch: Arch) -> dict[str, Shard | object]:
    """Point name -> its Shard, for the sharded points (and _UNREAD for the unknown ones)."""
    out: dict[str, Shard | object] = {}
    for name, spec in arch.specs.items():
        found = sides.of(spec)
        if found is not None:
            out[name] = found
    for name, spec in arch.specs.items():  # attention weights: the heads of the rank's queries
        if spec.needs_eager and spec.layer is not None:
            q = out.get(f"blocks.{spec.layer}.attn.q")
            if isinstance(q, Shard):
                heads = arch.n_heads or sides.size
                out[name] = Shard(spec.head_dim, sides.rank, sides.size, heads, sides.group)
    return out


# -- the collectives, differentiable --------------------------------------------------------------


def _all_gather(x: Tensor, shard: Shard, dim: int) -> Tensor:
    parts = [torch.empty_like(x) for _ in range(shard.size)]
    dist.all_gather(parts, x.contiguous(), group=shard.group)
    return torch.cat(parts, dim=dim)


class _Gather(torch.autograd.Function):
    """The ranks' slices -> the whole tensor; backward: the rank's slice of the (same on every
    rank) whole gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, shard: Shard, dim: int) -> Tensor:
        ctx.shard, ctx.dim = shard, dim
        return _all_gather(x, shard, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.shard.local(grad, ctx.dim).contiguous(), None, None


class _Local(torch.autograd.Function):
    """A whole tensor (the same on every rank) -> the rank's slice; backward: the ranks' slices of
    the gradient gathered, so a gradient read at the whole tensor is whole."""

    @staticmethod
    def forward(ctx, x: Tensor, shard: Shard, dim: int) -> Tensor:
        ctx.shard, ctx.dim = shard, dim
        return shard.local(x, dim).contiguous()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_gather(grad, ctx.shard, ctx.dim), None, None


def gather(x: Tensor, shard: Shard, dim: int | None = None) -> Tensor:
    dim = shard.dim if dim is None else dim
    if torch.is_grad_enabled() and x.requires_grad:
        return _Gather.apply(x, shard, dim)
    return _all_gather(x, shard, dim)


def local(whole: Tensor, shard: Shard, dim: int | None = None) -> Tensor:
    dim = shard.dim if dim is None else dim
    if torch.is_grad_enabled() and whole.requires_grad:
        return _Local.apply(whole, shard, dim)
    return shard.local(whole, dim)


# -- the views -------------------------------------------------------------------------------------


def _units(spec: PointSpec, shard: Shard) -> int | None:
    """How many heads a per-head point has (the rank's slice is named in heads), else None."""
    if spec.view is None or spec.view.head_dim is None:
        return shard.width if spec.head_dim is not None and spec.view is None else None
    probe = torch.empty((1, 1, shard.width), device="meta")
    return spec.view.get(probe).shape[spec.view.head_dim]


def _local_view(spec: PointSpec, shard: Shard, units: int | None) -> View | None:
    """The family's view on the rank's slice (`View.split`), checked to give the same heads."""
    view = spec.view
    if view is None or shard.dim != -1:
        return view
    if view.split is None:
        raise TensorParallelError(
            f"{spec.name}: its view ({view.label}) has no meaning on one rank's columns; this family's "
            "tensor-parallel plan is not supported by hookscope yet"
        )
    part = view.split(shard.size)
    if units is not None and units % shard.size:
        raise TensorParallelError(
            f"{spec.name}: {shard.size} ranks do not divide its {units} heads; "
            f"load with a tp that divides {units}"
        )
    return part


def _gathered(spec: PointSpec, shard: Shard) -> View:
    """The whole tensor's view on a sharded point: gather, then the family's view; `put` writes the
    rank's slice of the edited whole back through the view on the slice."""
    units = _units(spec, shard)
    whole, part = spec.view, _local_view(spec, shard, units)
    head_dim = whole.head_dim if whole is not None else spec.head_dim

    if whole is None:

        def get(raw: Tensor) -> Tensor:
            return gather(raw, shard)

        def put(raw: Tensor, new: Tensor) -> Tensor:
            return local(new, shard)
    else:

        def get(raw: Tensor) -> Tensor:
            return whole.get(gather(raw, shard))

        def put(raw: Tensor, new: Tensor) -> Tensor:
            return part.put(raw, local(new, shard, head_dim))

    label = f"{whole.label}; " if whole is not None else ""
    return View(
        get,
        put,
        f"{label}sharded over {shard.size} ranks (this one: {shard.describe(units)}), gathered",
        head_dim=head_dim,
        # split along the features, each row alone: a capture's positions are picked before the gather
        select_rows_first=shard.dim == -1,
    )


def _kept_sharded(spec: PointSpec, shard: Shard) -> View:
    """The view on the rank's slice alone (`gather=False`), its label naming the slice."""
    units = _units(spec, shard)
    part = _local_view(spec, shard, units)
    named = f"rank {shard.rank}'s slice: {shard.describe(units)}"
    if part is None:
        return View(lambda raw: raw, lambda raw, new: new, named, head_dim=None)
    return View(part.get, part.put, f"{part.label}; {named}", head_dim=part.head_dim, split=part.split)


def _whole(spec: PointSpec, size: int) -> View | None:
    """A whole point's view, unchanged but for its label (what `hs.points` says of it)."""
    view, said = spec.view, f"whole on each of the {size} ranks"
    if view is None:
        if spec.item is None:  # the view reads the whole call: leave it
            return None
        return View(lambda raw: raw, lambda raw, new: new, said)
    return dataclasses.replace(view, label=f"{view.label}; {said}")


def _unread(spec: PointSpec, style: str) -> View:
    def refuse(*_: Any) -> Tensor:
        raise TensorParallelError(
            f"{spec.name}: {spec.module} is sharded by transformers' {style!r} style, whose layout "
            "hookscope does not read yet; hook a whole point (resid_*, attn.out, mlp.out) instead"
        )

    return View(refuse, refuse, f"sharded by the {style!r} style (not readable)")


@dataclass
class _Table(Arch):
    """A tensor-parallel model's table: its points' views as `_table` made them, and a raw module
    point (`module:<path>:<io>`, made on demand by `Arch.spec`) on a split side given the same view."""

    change: Any = None  # PointSpec -> PointSpec, for the raw module points

    def spec(self, name: str) -> PointSpec:
        found = super().spec(name)
        if self.change is not None and found.name.startswith(MODULE_PREFIX) and found.name not in self.specs:
            return self.change(found)
        return found


def _table(model: nn.Module, arch: Arch, *, gather_points: bool) -> Arch:
    sides = _Sides(model)
    layouts = _layouts(sides, arch)

    def change(spec: PointSpec, shard: Shard | object | None) -> PointSpec:
        if shard is None:
            return dataclasses.replace(spec, view=_whole(spec, sides.size))
        if shard is _UNREAD:
            return dataclasses.replace(spec, view=_unread(spec, sides.styles[spec.module]))
        make = _gathered if gather_points else _kept_sharded
        return dataclasses.replace(spec, view=make(spec, shard))

    specs = {name: change(spec, layouts.get(name)) for name, spec in arch.specs.items()}
    fields = {f.name: getattr(arch, f.name) for f in dataclasses.fields(arch)}
    return _Table(**{**fields, "specs": specs}, change=lambda spec: change(spec, sides.of(spec)))


def _gathering_table(model: nn.Module, arch: Arch) -> Arch | None:
    """The change registered with the core: every tensor-parallel model's table gathers."""
    if not is_tensor_parallel(model):
        return None
    if not plan(model):
        raise TensorParallelError(
            f"{type(model).__name__} is split over {tp_size(model)} ranks with no tensor-parallel plan "
            "hookscope can read (model.tp_plan is empty)"
        )
    _SHARDED[model] = _table(model, arch, gather_points=False)
    return _table(model, arch, gather_points=True)


TABLE_CHANGES.append(_gathering_table)
_SHARDED: weakref.WeakKeyDictionary[nn.Module, Arch] = weakref.WeakKeyDictionary()


# -- the verbs' options ----------------------------------------------------------------------------


def sharded(model: nn.Module) -> Arch:
    """`model`'s table with every sharded point kept as this rank's slice (what `gather=False`
    reads the names in): pass it as `arch=` to `hs.hooks` or `hs.edit`'s verbs."""
    arch_of(model)
    table = _SHARDED.get(model)
    if table is None:
        raise TensorParallelError(
            f"gather=False keeps each rank's slice of a point sharded by tensor parallelism, and this "
            f"{type(model).__name__} is not sharded: every point is whole already. Drop gather=False, or "
            "load the model with hs.load(..., tp=N) under torchrun"
        )
    return table


def kept_shards(model: nn.Module, *, arch: Arch | None = None, heads: Any = None) -> Arch:
    """The table `hs.collect` / `hs.capture` / `hs.grads` read the names in with `gather=False`,
    after refusing what one rank's slice cannot give."""
    if arch is not None:
        raise TensorParallelError(
            "gather=False picks the table the names are read in (each rank's slices), and arch= gives "
            "another: give one of them (the slices' table is engines.tensor_parallel.sharded(model))"
        )
    if heads is not None:
        raise TensorParallelError(
            "heads= with gather=False: heads are global indices, and each rank holds only its own; "
            "gather (the default), or select the heads of the slice after the capture"
        )
    return sharded(model)


def layout(model: nn.Module) -> dict[str, Shard | None]:
    """Point name -> its Shard on this rank (None: whole on every rank), for a tensor-parallel
    model; what `hs.points(model)` says in words."""
    if not is_tensor_parallel(model):
        return dict.fromkeys(arch_of(model).specs)
    arch = arch_of(model)
    found = _layouts(_Sides(model), arch)
    return {
        name: (s if isinstance(s, Shard) else None) for name, s in ((n, found.get(n)) for n in arch.specs)
    }
