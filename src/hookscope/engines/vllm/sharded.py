"""Tensor-parallel vLLM engines: each rank's points, and the sharded ones gathered whole.

With `tensor_parallel_size = n`, vLLM splits a column-parallel projection's output columns across
the ranks (`ColumnParallelLinear` and its fused kinds: qkv_proj, gate_up_proj, GPT-2's c_attn /
c_fc) and so the input of the row-parallel one after it (o_proj, down_proj, c_proj), whose
output it all-reduces. A point on either of those sides holds this rank's 1/n of the columns:
its view is the table's view for one rank's slice (`View.split`, e.g. 2 of 4 heads), and the
captured rows are all-gathered across the ranks along the head dim (or the last), in rank order,
which is the whole tensor. Every other point (the residual stream, norms, attention and MLP
outputs) is the same whole tensor on every rank.
"""

from __future__ import annotations

import dataclasses

from torch import Tensor, nn

from ...arch.base import Arch, PointSpec
from ...errors import EngineError


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
