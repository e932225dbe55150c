"""A model's weight files opened for reading per tensor, and put in place by transformers' own loader.

Safetensors, or PyTorch's pickled `.bin` through `torch.load(mmap=True, weights_only=True)` as
transformers reads it, memory-mapped; the tensors are put in place by
`convert_and_load_state_dict_in_model` (its key renamings, its per-expert -> fused-expert
conversions, its dtype rules), exactly as `from_pretrained` would put them.
`Checkpoint.materialize` / `release` load and drop any set of modules on demand, so that a
`points=` load reads only what it needs and a block streamer can bring one block in and send it
back to `meta` without reopening the files.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..errors import ModelLoadError
from .safetensors_reads import TensorRead, page_in, safetensors_index


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


def open_safetensors(file: str, backend: str = "mmap") -> Any:
    """A safetensors file open for reading per tensor: memory-mapped (`"mmap"`), or read with
    `pread` (`"pread"`): a slice then reads its own bytes alone, and no page of the file stays
    mapped in the process (a column slice of a memory map touches every row's pages, and a row
    slice is a view that keeps the whole map, with all the pages read through it, alive)."""
    from safetensors import safe_open

    return safe_open(file, framework="pt", device="cpu", backend=backend)


def slices_of(handles: list[Any]) -> dict[str, Any]:
    """Stored name -> its safetensors slice (read when indexed), over the open files."""
    return {key: handle.get_slice(key) for handle in handles for key in handle.keys()}


class Checkpoint:
    """A model's weight files, open (memory-mapped, or with `backend="pread"` read per slice), with
    each key's target parameter name. A key's piece is a safetensors slice (read when indexed) or,
    from a `.bin` file, a tensor on torch.load's memory map (its pages read when touched)."""

    def __init__(self, model: nn.Module, files: list[str], dtype: torch.dtype | None, backend: str = "mmap"):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
        from transformers.modeling_utils import load_state_dict

        self.dtype = dtype
        self.mapping = get_model_conversion_mapping(model)
        safetensors = [f for f in files if f.endswith(".safetensors")]
        self._handles = [open_safetensors(f, backend) for f in safetensors]
        self._slices: dict[str, Any] = slices_of(self._handles)
        for pickled in (f for f in files if not f.endswith(".safetensors")):
            self._slices.update(load_state_dict(pickled))  # torch.load(mmap=True, weights_only=True)
        renamings = [m for m in self.mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in self.mapping if isinstance(m, WeightConverter)]
        state = model.state_dict()  # on meta: names, shapes and the dtypes the weights will have
        renamed = {
            key: rename_source_key(key, renamings, converters, model.base_model_prefix, state)
            for key in self._slices
        }
        self._target = {key: target for key, (target, _) in renamed.items()}
        self._read_directly = _direct_reads(safetensors, renamed, state, model, dtype)
        # (a .bin's tensor is converted whole by transformers, as from_pretrained does)
        converting = {
            key: state[t].dtype
            for key, t in self._target.items()
            if t in state
            and not isinstance(self._slices[key], torch.Tensor)
            and _STORED.get(self._slices[key].get_dtype(), state[t].dtype) != state[t].dtype
        }
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
        config = LoadStateDictConfig(
            device_map=device_map,
            dtype=self.dtype,
            weight_mapping=self.mapping,
            dtype_plan=model._get_dtype_plan(self.dtype),
        )
        # transformers < 5.16 takes a tensor-parallel plan as a fourth, required argument: none here
        older = "tp_plan" in inspect.signature(convert_and_load_state_dict_in_model).parameters
        with no_progress_bars():  # transformers 5 draws one per call: a streamer calls per block
            info, _ = convert_and_load_state_dict_in_model(model, chosen, config, *((None,) if older else ()))
        missing = sorted(k for k in info.missing_keys if wants(k) and k not in model.all_tied_weights_keys)
        if any(not _is_buffer(model, k) for k in missing):
            raise ModelLoadError(
                f"the checkpoint has no weights for {', '.join(missing[:5])}: it does not "
                "match the model's config; load it without points= to see transformers' "
                "report"
            )
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
                model.get_submodule(path).named_buffers(recurse=True)
            ):
                set_module_tensor_to_device(model, f"{path}.{name}", "meta")

    def direct_reads(self, names: Iterable[str]) -> dict[str, TensorRead] | None:
        """Where each of the parameters `names` lies, when every one is a tensor of a safetensors
        file that loading only renames (and converts to its dtype): such a block can be read straight
        into reused buffers (safetensors_reads.py). None when any is not (a fused or split weight, a
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


def _direct_reads(
    files: list[str],
    renamed: dict[str, tuple[str, str | None]],
    state: dict,
    model: nn.Module,
    dtype: torch.dtype | None,
) -> dict[str, TensorRead]:
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


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off for the duration, then back as the user had them."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()
