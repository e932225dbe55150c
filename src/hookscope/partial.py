"""Load only the weights that some points need; the rest of the model stays on `meta`.

The model is built on the `meta` device (no memory), then only the needed tensors are read from
the weight files (per tensor, memory-mapped: safetensors, or PyTorch's pickled `.bin` through
`torch.load(mmap=True, weights_only=True)`, as transformers reads it) and put in place by
transformers' own loader (`convert_and_load_state_dict_in_model`: its key renamings, its
per-expert -> fused-expert conversions, its dtype rules), exactly as `from_pretrained` would put
them. What is needed:

- the blocks up to the last point's block (whole blocks: a block is the unit streaming reuses);
- the prologue, every module the forward runs before the first block (embeddings, position
  embeddings, rotary tables, CLIP's pre-norm). It is found by running the family's forward on
  `meta` inputs in a throwaway `meta` copy of the model, stopped at the first block: generic, so a
  new family needs no table. Should that run fail, every module outside the blocks is taken;
- everything, for a point after the last block (`ln_final`, `logits`).

`Checkpoint.materialize` / `release` load and drop any set of modules on demand, so a block
streamer can bring one block in and send it back to `meta` without reopening the files.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .arch import Arch, PointSpec
from .block_buffers import TensorRead, page_in, safetensors_index
from .errors import ModelLoadError, PointNotLoadedError

# (index of shards, single file), in the order from_pretrained prefers them
_WEIGHT_FILES = (("model.safetensors.index.json", "model.safetensors"),
                 ("pytorch_model.bin.index.json", "pytorch_model.bin"))


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
                f"{list(self.points)}, {self.loaded()}. Load it without points=")

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
        return [path for path, m in model.named_modules() if any(
            t.is_meta and not self.wants(f"{path}.{leaf}" if path else leaf)
            for leaf, t in (*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)))]

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


class _Stop(Exception):
    pass


def prologue_modules(make_meta_model: Callable[[], nn.Module], first_block: str) -> set[str]:
    """The modules a forward runs before `first_block`, by running a fresh `meta` copy of the model
    on `meta` inputs up to there (a copy, since some forwards change state on their first call:
    RWKV rescales its weights)."""
    model = make_meta_model()
    ran: list[str] = []
    handles = [m.register_forward_pre_hook(lambda _m, _a, name=name: ran.append(name))
               for name, m in model.named_modules()]

    def stop(*_: Any) -> None:
        raise _Stop

    handles.append(model.get_submodule(first_block).register_forward_pre_hook(stop))
    try:
        with torch.no_grad():
            model(**_meta_inputs(model))
    except _Stop:
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


def checkpoint_files(source: str, **hub: Any) -> list[str]:
    """The weight files of a local directory or hub id (one file, or the shards of an index):
    safetensors where there are any, else PyTorch's `pytorch_model.bin`."""
    from transformers.utils.hub import cached_file

    def find(name: str) -> str | None:
        return cached_file(source, name, _raise_exceptions_for_missing_entries=False, **hub)

    for index_name, single_name in _WEIGHT_FILES:
        index = find(index_name)
        if index is not None:
            import json

            shards = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
            local = Path(source).is_dir()
            return [str(Path(index).parent / shard) if local else find(shard) for shard in shards]
        single = find(single_name)
        if single is not None:
            return [single]
    raise ModelLoadError(f"{source!r} has no safetensors or pytorch_model.bin weights: points= reads them "
                         "tensor by tensor")


def stored_dtype(files: list[str]) -> torch.dtype:
    """The dtype of the checkpoint's first floating weight: what `from_pretrained`'s default
    (`dtype="auto"`) loads when the config names none."""
    from safetensors import safe_open

    if not files[0].endswith(".safetensors"):  # a pickled .bin: transformers' own reading of it
        from transformers.modeling_utils import get_state_dict_dtype, load_state_dict

        return get_state_dict_dtype(load_state_dict(files[0], map_location="meta"))
    with safe_open(files[0], "pt") as f:
        for key in f.keys():
            stored = _STORED.get(f.get_slice(key).get_dtype())
            if stored is not None:
                return stored
    return torch.float32


class Checkpoint:
    """A model's weight files, open (memory-mapped), with each key's target parameter name. A
    key's piece is a safetensors slice (read when indexed) or, from a `.bin` file, a tensor on
    torch.load's memory map (its pages read when touched)."""

    def __init__(self, model: nn.Module, files: list[str], dtype: torch.dtype | None):
        from safetensors import safe_open
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
        from transformers.modeling_utils import load_state_dict

        self.dtype = dtype
        self.mapping = get_model_conversion_mapping(model)
        safetensors = [f for f in files if f.endswith(".safetensors")]
        self._handles = [safe_open(f, framework="pt", device="cpu") for f in safetensors]
        self._slices: dict[str, Any] = {key: h.get_slice(key) for h in self._handles for key in h.keys()}
        for pickled in (f for f in files if not f.endswith(".safetensors")):
            self._slices.update(load_state_dict(pickled))  # torch.load(mmap=True, weights_only=True)
        renamings = [m for m in self.mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in self.mapping if isinstance(m, WeightConverter)]
        state = model.state_dict()  # on meta: names, shapes and the dtypes the weights will have
        renamed = {key: rename_source_key(key, renamings, converters, model.base_model_prefix, state)
                   for key in self._slices}
        self._target = {key: target for key, (target, _) in renamed.items()}
        self._read_directly = _direct_reads(safetensors, renamed, state, model, dtype)
        # (a .bin's tensor is converted whole by transformers, as from_pretrained does)
        converting = {key: state[t].dtype for key, t in self._target.items() if t in state
                      and not isinstance(self._slices[key], torch.Tensor)
                      and _STORED.get(self._slices[key].get_dtype(), state[t].dtype) != state[t].dtype}
        if converting and not model._get_dtype_plan(dtype):
            files_of = {key: f for f, h in zip(safetensors, self._handles, strict=True) for key in h.keys()}
            for key, target_dtype in converting.items():
                self._slices[key] = _Converting(files_of[key], key, self._slices[key], target_dtype)

    def materialize(self, model: nn.Module, wants: Callable[[str], bool], device_map: dict) -> None:
        """Read the tensors whose target `wants` names and put them in `model` (on their device
        in `device_map`); then the wanted buffers that no file holds (rotary tables, position ids)
        are computed, and tied weights tied, as `from_pretrained` does."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        chosen = {key: s for key, s in self._slices.items() if wants(self._target[key])}
        config = LoadStateDictConfig(device_map=device_map, dtype=self.dtype, weight_mapping=self.mapping,
                                     dtype_plan=model._get_dtype_plan(self.dtype))
        # transformers < 5.16 takes a tensor-parallel plan as a fourth, required argument: none here
        older = "tp_plan" in inspect.signature(convert_and_load_state_dict_in_model).parameters
        info, _ = convert_and_load_state_dict_in_model(model, chosen, config, *((None,) if older else ()))
        missing = sorted(k for k in info.missing_keys if wants(k) and k not in model.all_tied_weights_keys)
        if any(not _is_buffer(model, k) for k in missing):
            raise ModelLoadError(f"the checkpoint has no weights for {', '.join(missing[:5])}: it does not "
                                 "match the model's config; load it without points= to see transformers' "
                                 "report")
        model.mark_tied_weights_as_initialized(info)
        _fill_buffers(model, wants, device_map)
        model.initialize_weights()  # computes the buffers just placed; loaded weights are flagged, kept
        model.tie_weights(recompute_mapping=False)

    def prefetch(self, wants: Callable[[str], bool]) -> None:
        """Read the tensors `materialize(model, wants, ...)` will read, one at a time and dropped, so
        that its reads hit the page cache: a read-ahead thread's job, touching nothing in a model
        (transformers' loader is not safe to run beside a forward pass)."""
        for key, piece in self._slices.items():
            if not wants(self._target[key]):
                continue
            if isinstance(piece, torch.Tensor):
                piece.clone()  # a view of the memory map reads nothing: copying it does
            elif isinstance(piece, _Converting):  # (read whole, it would be converted too)
                page_in(safetensors_index(piece.file)[piece.key])
            elif piece.get_shape():
                piece[:]

    def release(self, model: nn.Module, modules: Iterable[str]) -> None:
        """Send the parameters and buffers of `modules` back to `meta` (their memory is freed)."""
        from accelerate.utils import set_module_tensor_to_device

        for path in modules:
            for name, _ in list(model.get_submodule(path).named_parameters(recurse=True)) + list(
                    model.get_submodule(path).named_buffers(recurse=True)):
                set_module_tensor_to_device(model, f"{path}.{name}", "meta")

    def direct_reads(self, names: Iterable[str]) -> dict[str, TensorRead] | None:
        """Where each of the parameters `names` lies, when every one is a tensor of a safetensors
        file that loading only renames (and converts to its dtype): such a block can be read straight
        into reused buffers (block_buffers.py). None when any is not (a fused or split weight, a
        pickled `.bin`, a dtype plan, a tied weight): `materialize` then loads it."""
        reads = {name: self._read_directly.get(name) for name in names}
        return None if any(read is None for read in reads.values()) else reads

    def close(self) -> None:
        self._slices.clear()
        self._handles.clear()


_STORED = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_CHUNK_BYTES = 4 * 2**20


class _Converting:
    """A tensor that transformers' loader reads whole (`slice[...]`) and then converts, read
    instead in row chunks converted one by one, each through its own short-lived memory map: the
    pages a map has read stay resident until it is closed, so one map for the whole load would keep
    every float32 page next to its bfloat16 copy (3x the converted weights at peak)."""

    def __init__(self, file: str, key: str, stored: Any, dtype: torch.dtype):
        self.file, self.key, self.dtype = file, key, dtype
        self.shape, self.stored_dtype = stored.get_shape(), _STORED[stored.get_dtype()]

    def __getitem__(self, index: Any) -> torch.Tensor:
        from safetensors import safe_open

        out = torch.empty(self.shape, dtype=self.dtype)
        rows = self.shape[0] if self.shape else 1
        row_bytes = max(1, out[0].numel() if self.shape else 1) * self.stored_dtype.itemsize
        step = max(1, _CHUNK_BYTES // row_bytes)
        for start in range(0, rows, step):  # (a safetensors slice does not clip its end)
            stop = min(start + step, rows)
            with safe_open(self.file, framework="pt", device="cpu") as handle:
                piece = handle.get_slice(self.key)
                if self.shape:
                    out[start:stop] = piece[start:stop]
                else:
                    out.copy_(piece[...])
        return out[index]


def _direct_reads(files: list[str], renamed: dict[str, tuple[str, str | None]], state: dict, model: nn.Module,
                  dtype: torch.dtype | None) -> dict[str, TensorRead]:
    """Target parameter -> its stored tensor, for the targets only renamed from one stored tensor of
    their shape (a float converted to a float dtype, anything else kept)."""
    if model._get_dtype_plan(dtype):
        return {}
    tied = {*model.all_tied_weights_keys, *model.all_tied_weights_keys.values()}
    stored = {key: read for f in files for key, read in safetensors_index(f).items()}
    reads: dict[str, TensorRead] = {}
    sources: dict[str, int] = {}
    for key, (target, converter) in renamed.items():
        sources[target] = sources.get(target, 0) + 1
        read, want = stored.get(key), state.get(target)
        if converter is not None or read is None or want is None or target in tied:
            continue
        floats = read.stored.is_floating_point and want.dtype.is_floating_point
        same_kind = read.stored == want.dtype or floats
        if read.shape == tuple(want.shape) and same_kind:
            reads[target] = read
    return {target: read for target, read in reads.items() if sources[target] == 1}


def _is_buffer(model: nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    return leaf in model.get_submodule(owner)._buffers


def _fill_buffers(model: nn.Module, wants: Callable[[str], bool], device_map: dict) -> None:
    """Give the wanted buffers still on `meta` real (empty) storage for `initialize_weights` to fill."""
    from accelerate.utils import set_module_tensor_to_device
    from transformers.integrations.accelerate import get_device

    for name, buffer in list(model.named_buffers()):
        if buffer.is_meta and wants(name):
            device = get_device(device_map, name, valid_torch_device=True)
            set_module_tensor_to_device(model, name, device, value=torch.empty_like(buffer, device=device))
