"""What names a model in a store's settings: its name, class and the hash of its config (the
tokenizer's hash is `models.tokenizer_hash`, which the store's readers check too)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..models import sha256_text

if TYPE_CHECKING:
    from ..models import Loaded


def model_identity(loaded: Loaded) -> dict[str, str]:
    """The settings that name the model: its name or path, its class and the hash of its config."""
    return {"model": loaded.name, "model_class": type(loaded.model).__name__,
            "config_sha256": sha256_text(loaded.model.config.to_json_string(use_diff=False))}
