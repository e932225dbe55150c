"""What names a model in a store's settings: hashes of its config, tokenizer and image processor.
Public because a store's readers check them too (the CLI's `top` finds the store's tokenizer and
refuses another one whose hash differs)."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..models import Loaded


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def tokenizer_sha256(tokenizer: Any) -> str:
    """The hash of a tokenizer's full definition (a fast tokenizer's JSON, else its vocabulary)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return sha256_text(text)


def model_identity(loaded: Loaded) -> dict[str, str]:
    """The settings that name the model: its name or path, its class and the hash of its config."""
    return {"model": loaded.name, "model_class": type(loaded.model).__name__,
            "config_sha256": sha256_text(loaded.model.config.to_json_string(use_diff=False))}
