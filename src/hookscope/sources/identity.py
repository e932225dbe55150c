"""What names a model in a store's settings: its name, class and the hash of its config (the
tokenizer's hash is `models.tokenizer_hash`, which the store's readers check too); and the meaning
of each stored point whose meaning changed in this hookscope (`point_meanings`)."""

from __future__ import annotations

import re
from typing import Any

from ..arch import arch_of, meaning_changes
from ..loading import Loaded, sha256_text


def model_identity(loaded: Loaded) -> dict[str, str]:
    """The settings that name the model: its name or path, its class and the hash of its config."""
    return {
        "model": loaded.name,
        "model_class": type(loaded.model).__name__,
        "config_sha256": sha256_text(loaded.model.config.to_json_string(use_diff=False)),
    }


def point_meanings(loaded: Loaded, points: list[str]) -> dict[str, Any]:
    """`{"point_meanings": {point: {"means": ..., "before": ...}}}` for the points whose meaning
    changed in this hookscope on this model (Gemma 2's `blocks.3.mlp.out`: now after the post-norm),
    else `{}`: every other store's settings, and so their hash, stay as they were. A store written
    before the change lacks the record, so its settings differ and a resume is refused
    (store/meanings.py says why)."""
    changes = meaning_changes(arch_of(loaded.model))
    record = {}
    for name in points:
        suffix = re.sub(r"^blocks\.\d+\.", "", name)  # a block's point, or a top-level one (ln_final)
        if suffix in changes:
            now, before = changes[suffix]
            record[name] = {"means": now, "before": before}
    return {"point_meanings": record} if record else {}
