"""What block streaming keeps resident under `max_memory`, which block each point is read in, and
how many batches a chunk holds (`plan_stream`); `parse_size` reads a size such as 2GiB."""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from ..arch import Arch
from ..errors import HookscopeError
from ..names import MODULE_PREFIX

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(size: str | int) -> int:
    """Bytes in a size such as 2GiB, 500MB, 1.5G or 1048576."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(size))
    unit = match and _UNITS.get(match.group(2).lower())
    if not match or unit is None or float(match.group(1)) <= 0:
        raise HookscopeError(f"--max-memory {size!r}: give a size such as 2GiB, 500MB or 1.5GB")
    return int(float(match.group(1)) * unit)


def names_under(model: nn.Module, prefix: str) -> list[str]:
    """The parameter names of the module at `prefix` ("" is the whole model), in full."""
    module = model.get_submodule(prefix) if prefix else model
    dot = prefix + "." if prefix else ""
    return [dot + name for name, _ in module.named_parameters()]


def nbytes(model: nn.Module, names: list[str]) -> int:
    """What parameters `names` take once materialized, on meta or not."""
    params = dict(model.named_parameters())
    return sum(params[n].numel() * params[n].element_size() for n in names)


def resident_bytes(model: nn.Module) -> int:
    """What the model's parameters off meta take now (a tied weight counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)


@dataclass(frozen=True)
class StreamPlan:
    """What a streamed extraction keeps resident, which block each point is read in, and how many
    batches a chunk holds."""

    stage_of: dict[str, int]  # point -> block index (n_layers: after the last block)
    last_block: int  # the last block any point needs
    resident: list[str]  # parameters kept for the whole run (outside the blocks)
    blocks: list[list[str]]  # block k's parameters, for the blocks that run
    read_ahead: bool  # whether two blocks fit: the next one is read while this one computes
    chunk_batches: int
    weight_limit: int  # bytes: the resident weights + one block, or two with read-ahead


def plan_stream(
    model: nn.Module,
    arch: Arch,
    points: list[str],
    max_memory: int,
    *,
    batch_size: int,
    context: int,
    store_itemsize: int,
) -> StreamPlan:
    """The plan for streaming `points` under `max_memory` bytes; a clear error if one block and the
    weights outside the blocks do not fit together."""
    n_layers = arch.n_layers
    if n_layers == 0:
        raise HookscopeError(
            f"--max-memory streams a model block by block, and this {arch.family} model "
            "has no blocks hookscope knows; run without --max-memory"
        )
    stage_of = {p: _stage(arch, p) for p in points}
    last_block = min(max(stage_of.values()), n_layers - 1)
    blocks = [names_under(model, arch.block_paths[k]) for k in range(last_block + 1)]
    in_blocks = {n for k in range(n_layers) for n in names_under(model, arch.block_paths[k])}
    skip = set() if max(stage_of.values()) == n_layers else set(_output_embedding_names(model))
    resident = [n for n in names_under(model, "") if n not in in_blocks and n not in skip]
    fixed, largest = nbytes(model, resident), max(nbytes(model, b) for b in blocks)
    if fixed + largest > max_memory:
        raise HookscopeError(
            f"--max-memory {_size(max_memory)} holds less than the weights needed at once: {_size(fixed)} "
            f"outside the blocks + {_size(largest)} for the largest block = {_size(fixed + largest)}; give "
            f"at least that (with the next block read ahead: {_size(fixed + 2 * largest)})"
        )
    read_ahead = fixed + 2 * largest <= max_memory
    weight_limit = fixed + (2 if read_ahead else 1) * largest
    # a chunk's hidden states (a block's input and output) and kept rows take what the weights leave
    compute_itemsize = next(iter(model.parameters())).element_size()
    per_sequence = context * _width(model, arch) * (2 * compute_itemsize + len(points) * store_itemsize)
    chunk_batches = max(1, (max_memory - weight_limit) // (per_sequence * batch_size))
    return StreamPlan(stage_of, last_block, resident, blocks, read_ahead, int(chunk_batches), weight_limit)


def _stage(arch: Arch, point: str) -> int:
    """The block a point is read in: the one holding its module; before the first block: 0; after
    the last one: n_layers (a pass through stand-ins only)."""
    block = _block_of(arch, arch.spec(point).module)
    if block is not None:
        return block
    order = list(arch.specs)
    if point.startswith(MODULE_PREFIX) or point not in order:
        raise HookscopeError(
            f"{point}: under --max-memory, points are read block by block; name points of "
            "the blocks (or embed / ln_final / logits), or run without --max-memory"
        )
    first = next(i for i, name in enumerate(order) if _block_of(arch, arch.specs[name].module) is not None)
    return 0 if order.index(point) < first else arch.n_layers  # in execution order: before or after


def _block_of(arch: Arch, module: str) -> int | None:
    return next(
        (k for k, path in enumerate(arch.block_paths) if module == path or module.startswith(path + ".")),
        None,
    )


def _output_embedding_names(model: nn.Module) -> list[str]:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for path, module in model.named_modules():
        if head is not None and module is head:
            return names_under(model, path)
    return []


def _width(model: nn.Module, arch: Arch) -> int:
    config = getattr(model, "config", None)
    return int(arch.d_model or getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0) or 1)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"
