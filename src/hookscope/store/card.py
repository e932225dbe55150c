"""The store's dataset card (README.md): what a person or the Hugging Face tools see first.

`datasets.load_dataset(STORE_DIR)` would otherwise take manifest.json for the data and silently
return one row holding the manifest. The card's YAML header names the only data file of its one
configuration as a sentence saying what the folder is; no such file exists, so `load_dataset`
fails with that sentence in its error ("Unable to find '.../This is a hookscope activation
store...'") instead of misreading the store. The card's text says how to read or convert it.
"""

from __future__ import annotations

import os
from pathlib import Path

CARD = "README.md"
NOT_A_DATASET = ("This is a hookscope activation store, not a datasets folder - read it with "
                 "hookscope.open_store(DIR), "
                 "or convert it with hookscope export DIR --format hf --out NEW_DIR")

_TEXT = f"""---
configs:
- config_name: default
  data_files: "{NOT_A_DATASET}"
tags:
- hookscope
- activations
---
# A hookscope activation store

Activations of a model, one row per token, in `shards/*.safetensors`; `manifest.json` lists the
shards and the settings that made them (model, points, dtype, context, data). This folder is not
a Hugging Face `datasets` folder: `datasets.load_dataset` on it fails on purpose.

- Read it: `hookscope.open_store(DIR)` (memory-mapped), `store.dataset(point, batch_size=4096,
  repeat=True)` for training.
- Convert it: `hookscope export DIR --format hf --out NEW_DIR` (then `datasets.load_from_disk`), or
  `--format saelens` for SAELens's cached-activations layout.
- Check it: `hookscope inspect DIR`.
"""


def card_bytes() -> bytes:
    """The card's bytes, for a store at a URL (written with one PUT)."""
    return _TEXT.encode("utf-8")


def write_card(root: str | os.PathLike) -> None:
    """Write the card unless the store already has one (atomic: a reader sees all of it or none)."""
    path = Path(root) / CARD
    if path.exists():
        return
    tmp = path.with_name(f"{CARD}.{os.getpid()}.tmp")
    try:
        tmp.write_text(_TEXT, encoding="utf-8")
        # os.rename, not os.replace: the fault-injection tests count os.replace calls as the store's
        # own commits (shards, manifest); the card is not one (same atomic rename on POSIX)
        os.rename(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
