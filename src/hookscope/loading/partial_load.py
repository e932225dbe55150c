"""What a `points=` load materializes; the rest of the model stays on `meta`.

The model is built on the `meta` device (no memory), then only the needed tensors are read from
its checkpoint (`checkpoint.py`; `loader.py` does it). What is needed:

- the blocks up to the last point's block (whole blocks: a block is the unit streaming reuses);
- the prologue, every module the forward runs before the first block (embeddings, position
  embeddings, rotary tables, CLIP's pre-norm). It is found by running the family's forward on
  `meta` inputs in a throwaway `meta` copy of the model, stopped at the first block: generic, so a
  new family needs no table. Should that run fail, every module outside the blocks is taken;
- everything, for a point after the last block (`ln_final`, `logits`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..arch import Arch, PointSpec
from ..errors import PointNotLoadedError
from ..stopping import Stop


@dataclass(frozen=True)
class PartialLoad:
    """What a `points=` load materialized: blocks 0..`through` (`through == n_blocks`: everything)."""

    points: tuple[str, ...]
    through: int
    block_paths: tuple[str, ...]
    prologue: frozenset[str]

    @property
    def everything(self) -> bool:
        return self.through >= len(self.block_paths)

    def needs(self, spec: PointSpec) -> int:
        """The last block a point needs: -1 for a prologue point, n_blocks for one after the blocks."""
        if spec.layer is not None:
            return spec.layer
        for index, path in enumerate(self.block_paths):
            if spec.module == path or spec.module.startswith(path + "."):
                return index
        return -1 if spec.module in self.prologue else len(self.block_paths)

    def reaches(self, spec: PointSpec) -> bool:
        """Whether the point's weights, and those before it, were loaded."""
        return self.everything or self.needs(spec) <= self.through

    def check(self, spec: PointSpec) -> None:
        """Refuse a hook on a point whose weights (or those before it) were not loaded."""
        if self.reaches(spec):
            return
        raise PointNotLoadedError(
            f"{spec.name} needs weights this model does not have: it was loaded with points="
            f"{list(self.points)}, {self.loaded()}. Load it again with hs.load(..., points=["
            f"{', '.join(repr(p) for p in (*self.points, spec.name))}]), or without points= for every point"
        )

    def require_output(self, what: str) -> None:
        """Refuse a verb that needs the model's output (`what` says why) on a model that cannot
        produce it, before anything runs."""
        if not self.everything:
            raise PointNotLoadedError(
                f"{what}, which needs every weight: this model was loaded with points="
                f"{list(self.points)}, {self.loaded()}. Load it without points="
            )

    def loaded(self) -> str:
        if self.through < 0:
            return "the embeddings only (no block)"
        return f"the embeddings and blocks 0-{self.through} of {len(self.block_paths)}"

    def wants(self, name: str) -> bool:
        """Whether the parameter / buffer `name` (a state-dict key) is one to materialize."""
        if self.everything:
            return True
        owner = name.rpartition(".")[0]
        if owner in self.prologue:
            return True
        return any(owner == p or owner.startswith(p + ".") for p in self.block_paths[: self.through + 1])

    @property
    def blocks_loaded(self) -> int:
        """How many blocks, from the first, have their weights."""
        return len(self.block_paths) if self.everything else self.through + 1

    def left_out(self) -> str:
        """What a pass must not reach, for a report: 'blocks 2-15 of 16 and what follows'."""
        n = len(self.block_paths)
        first = self.through + 1
        if first >= n:
            return f"the modules after block {n - 1} (the last)"
        blocks = f"block {first}" if first == n - 1 else f"blocks {first}-{n - 1}"
        return f"{blocks} of {n} and what follows"

    def frontier(self, model: nn.Module) -> list[str]:
        """The first modules left on `meta`, one of which a pass reaches right after the loaded
        blocks: the next block; after the last block, the final norm and head (a module whose
        weights are on `meta` because accelerate offloaded them is wanted, and not one of them)."""
        if self.everything:
            return []
        if self.through + 1 < len(self.block_paths):
            return [self.block_paths[self.through + 1]]
        return [
            path
            for path, m in model.named_modules()
            if any(
                t.is_meta and not self.wants(f"{path}.{leaf}" if path else leaf)
                for leaf, t in (*m.named_parameters(recurse=False), *m.named_buffers(recurse=False))
            )
        ]

    def guard(self, model: nn.Module) -> list[Any]:
        """Pre-hooks on the `frontier` modules: a forward that reaches one (a pass not stopped after
        its last point) gets this error instead of one from inside torch."""
        paths = self.frontier(model)

        def refuse(module: nn.Module, args: tuple, kwargs: dict) -> None:
            path = next(p for p in paths if model.get_submodule(p) is module)
            raise PointNotLoadedError(
                f"the forward pass reached {path}, whose weights were not loaded (the model was loaded "
                f"with points={list(self.points)}, {self.loaded()}): stop the pass after the last "
                "point (hs.collect, capture(...).run, or capture(..., stop=True)), or load the model "
                "without points="
            )

        return [model.get_submodule(p).register_forward_pre_hook(refuse, with_kwargs=True) for p in paths]


def plan(arch: Arch, specs: Iterable[PointSpec], prologue: set[str], points: Iterable[str]) -> PartialLoad:
    """Which blocks to load for `specs` (all of them when one lies after the blocks)."""
    partial = PartialLoad(tuple(points), -1, tuple(arch.block_paths), frozenset(prologue))
    through = max((partial.needs(s) for s in specs), default=-1)
    return PartialLoad(partial.points, through, partial.block_paths, partial.prologue)


def prologue_modules(make_meta_model: Callable[[], nn.Module], first_block: str) -> set[str]:
    """The modules a forward runs before `first_block`, by running a fresh `meta` copy of the model
    on `meta` inputs up to there (a copy, since some forwards change state on their first call:
    RWKV rescales its weights)."""
    model = make_meta_model()
    ran: list[str] = []
    handles = [
        m.register_forward_pre_hook(lambda _m, _a, name=name: ran.append(name))
        for name, m in model.named_modules()
    ]
    stop = Stop()
    handles.append(stop.before(model.get_submodule(first_block)))  # after the block's name is recorded
    try:
        with torch.no_grad():
            _, stopped = stop.run(model, _meta_inputs(model))
        if stopped:
            return set(ran)
    except Exception:  # a forward that cannot run on meta: every module outside the blocks
        pass
    finally:
        for handle in handles:
            handle.remove()
    return {name for name, _ in model.named_modules()}


def _meta_inputs(model: nn.Module) -> dict[str, torch.Tensor]:
    config = model.config
    if getattr(model, "main_input_name", "input_ids") == "pixel_values":
        size = getattr(config, "image_size", 224)
        channels = getattr(config, "num_channels", 3)
        return {"pixel_values": torch.empty(1, channels, size, size, device="meta")}
    return {"input_ids": torch.zeros(1, 4, dtype=torch.long, device="meta")}
