"""A model's tokenizer, and the hashes a store records to name a tokenizer or a config."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..errors import ModelLoadError
from .weight_files import resolve_source


def sha256_text(text: str) -> str:
    """The SHA-256 (hex) of a text's UTF-8 bytes: how a store's settings name a tokenizer, a model
    config or an image processor."""
    return hashlib.sha256(text.encode()).hexdigest()


def tokenizer_hash(tokenizer: Any) -> str:
    """SHA-256 of a tokenizer's whole definition: a store records it, so that the tokens it holds are
    decoded later with the tokenizer that made them."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return sha256_text(text)


def load_tokenizer(name: str, *, saved_alone: bool = False, sha256: str | None = None) -> Any:
    """The tokenizer of a model `name` (a path, a hub id or the bundled default), or of a directory
    holding a tokenizer saved alone (`saved_alone`, no config.json); refused when `sha256` is given
    and is not its `tokenizer_hash`."""
    from transformers import AutoTokenizer

    source, local = (name, True) if saved_alone else resolve_source(name)
    try:
        tok = AutoTokenizer.from_pretrained(source, local_files_only=local)
    except (OSError, ValueError) as e:
        raise ModelLoadError(
            f"cannot load the tokenizer of {name!r} ({e}); give --tokenizer PATH_OR_ID"
        ) from e
    if sha256 and tokenizer_hash(tok) != sha256:
        raise ModelLoadError(
            f"the tokenizer of {name!r} is not the one this store was made with (its hash "
            "differs from the manifest's tokenizer_sha256); give the right --tokenizer"
        )
    return tok
