"""Tensor-parallel vLLM engines: each rank's points, and the sharded ones gathered whole.

With `tensor_parallel_size = n`, vLLM splits a column-parallel projection's output columns across
the ranks (`ColumnParallelLinear` and its fused kinds: qkv_proj, gate_up_proj, GPT-2's c_attn /
c_fc) and so the input of the row-parallel one after it (o_proj, down_proj, c_proj), whose
output it all-reduces. A point on either of those sides holds this rank's 1/n of the columns:
its view is the table's view for one rank's slice (`View.split`, e.g. 2 of 4 heads), and the
captured rows are all-gathered across the ranks along the head dim (or the last), in rank order,
which is the whole tensor. Every other point (the residual stream, norms, attention and MLP
outputs) is the same whole tensor on every rank.

An edit given in whole-model terms at a sharded point is cut the same way for each rank
(`edit_on_rank`): along the dim the captures are gathered on, the rank's part in rank order
(`Shard.local`, the Hugging Face tensor-parallel path's own cut): a steering vector, an ablation's
mean or a patch's source sliced, and the heads an edit names (global indices) made this rank's own,
or no edit at all where the rank holds none of them.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from ...arch.base import Arch, PointSpec
from ...edit import Ablate, Edit, Patch, Steer
from ...errors import EngineError
from ..tensor_parallel import Shard


def _sharded_side(model: nn.Module, spec: PointSpec) -> bool:
    """Whether vLLM splits this side of the spec's module across the tensor-parallel ranks."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    module = model.get_submodule(spec.module)
    if isinstance(module, ColumnParallelLinear):
        return spec.io == "output" and not module.gather_output
    return isinstance(module, RowParallelLinear) and spec.io == "input" and module.input_is_parallel


def rank_table(arch: Arch, model: nn.Module, n_ranks: int) -> tuple[Arch, dict[str, int]]:
    """The table as one rank of `n_ranks` sees its model, and the dim each sharded point is
    gathered along ({name: dim}); an error for a sharded point whose view has no per-rank form."""
    specs, gather = dict(arch.specs), {}
    for name, spec in arch.specs.items():
        if not _sharded_side(model, spec):
            continue
        view = spec.view
        if view is not None and view.split is None:
            raise EngineError(
                f"{name} is split across the {n_ranks} tensor-parallel ranks and its view "
                f"({view.label}) has no per-rank form: capture it with tensor_parallel_size=1"
            )
        specs[name] = dataclasses.replace(spec, view=view.split(n_ranks)) if view else spec
        gather[name] = view.head_dim if view is not None and view.head_dim is not None else -1
    return dataclasses.replace(arch, specs=specs), gather


def gather(rows: Tensor, dim: int) -> Tensor:
    """This rank's columns of a sharded point and every other rank's, whole (a collective: every
    rank calls it for the same point of the same forward)."""
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(rows.contiguous(), dim=dim % rows.dim())


def for_rank(arch: Arch, model: nn.Module) -> tuple[Arch, dict[str, int]]:
    """`rank_table` for this worker's rank; the table as is, nothing to gather, without tensor
    parallelism."""
    from vllm.distributed import get_tensor_model_parallel_world_size

    n_ranks = get_tensor_model_parallel_world_size()
    return rank_table(arch, model, n_ranks) if n_ranks > 1 else (arch, {})


def hands_off() -> bool:
    """Whether this worker hands the rows back: the first rank (every rank holds them whole)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank() == 0


def rank_shard(model: nn.Module, spec: PointSpec, dim: int) -> tuple[Shard, tuple[int, ...]]:
    """How this rank's slice of a sharded point (`spec` from the rank's table, gathered along `dim`)
    sits in the whole point: its `Shard` along `dim` and the whole point's shape after [tokens]."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    module = model.get_submodule(spec.module)
    if getattr(module, "num_kv_head_replicas", 1) > 1 and spec.name.endswith(("attn.k", "attn.v")):
        raise EngineError(
            f"{spec.name}: this engine has fewer key / value heads than tensor-parallel ranks, so each "
            "rank holds a copy of one head, not a slice: edit it with tensor_parallel_size at most the "
            "number of key / value heads"
        )
    width = module.output_size_per_partition if spec.io == "output" else module.input_size_per_partition
    probe = torch.empty((1, width), device="meta")  # one token of the rank's raw columns
    shape = list((spec.view.get(probe) if spec.view is not None else probe).shape[1:])
    n_ranks = get_tensor_model_parallel_world_size()
    shape[dim] *= n_ranks
    return Shard(dim, get_tensor_model_parallel_rank(), n_ranks, shape[dim], group=None), tuple(shape)


def edit_on_rank(edit: Edit, model: nn.Module, spec: PointSpec, dim: int) -> Edit | None:
    """`edit`, given for the whole point, as this rank writes it on its slice; None where it writes
    nothing here (heads all held by other ranks). An error naming the fix for a value that is neither
    the whole point's shape nor broadcast to it."""
    shard, shape = rank_shard(model, spec, dim)
    changes: dict = {}
    if edit.heads is not None and spec.view is not None and spec.view.head_dim is not None:
        heads = _local_heads(edit.heads, shard, spec.name)
        if not heads:
            return None
        changes["heads"] = heads
    if isinstance(edit, Steer):
        changes["vector"] = _local_value(edit.vector, shard, shape, f"steer {spec.name}: the vector")
    if isinstance(edit, Ablate) and edit.mean is not None:
        changes["mean"] = _local_value(edit.mean, shard, shape, f"ablate {spec.name}: the mean")
    if isinstance(edit, Patch):
        changes["source"] = _local_source(edit.source, shard, shape, spec.name)
    return dataclasses.replace(edit, **changes) if changes else edit


def _local_heads(heads, shard: Shard, name: str) -> list[int]:
    """Global head indices -> those this rank holds, counted in its slice."""
    values = torch.as_tensor(heads).flatten().tolist()
    wrong = [h for h in values if not -shard.width <= h < shard.width]
    if wrong:
        raise EngineError(
            f"heads {wrong} at {name}, which has {shard.width} heads: give indices below {shard.width}"
        )
    first = shard.rank * shard.part
    return [h % shard.width - first for h in values if first <= h % shard.width < first + shard.part]


def _local_value(value: Tensor, shard: Shard, shape: tuple[int, ...], what: str) -> Tensor:
    """A value added or written at every token (a steering vector, a mean): this rank's part where it
    spans the split dim, else as it is (broadcast alike on every rank)."""
    try:
        fits = torch.broadcast_shapes(tuple(value.shape), shape) == shape
    except RuntimeError:
        fits = False
    if not fits:
        raise EngineError(
            f"{what} has shape {tuple(value.shape)}, and the whole point (all tensor-parallel ranks' slices) "
            f"is {shape} per token: give that shape (as hs.collect returns it, without the tokens) or one "
            "that broadcasts to it"
        )
    spans = value.dim() >= -shard.dim and value.shape[shard.dim] == shard.width
    return shard.local(value).contiguous() if spans else value


def _local_source(source: Tensor, shard: Shard, shape: tuple[int, ...], name: str) -> Tensor:
    """A patch's source ([1, tokens, ...whole point]) cut to this rank's part."""
    if tuple(source.shape[2:]) != shape:
        raise EngineError(
            f"patch {name}: the source is {tuple(source.shape[1:])} and the whole point (all "
            f"tensor-parallel ranks' slices) is {shape} per token: give the whole point's rows, as "
            "hs.collect on the engine returns them"
        )
    return shard.local(source).contiguous()
