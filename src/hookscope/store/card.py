"""The store's dataset card (README.md): what a person or the Hugging Face tools see first.

`datasets.load_dataset(STORE_DIR)` would otherwise take manifest.json for the data and silently
return one row holding the manifest. The card's YAML header names the only data file of its one
configuration as a sentence saying what the folder is; no such file exists, so `load_dataset`
fails with that sentence in its error ("Unable to find '.../This is a hookscope activation
store...'") instead of misreading the store. The card's text says how to read or convert it.
"""

from __future__ import annotations

CARD = "README.md"
NOT_A_DATASET = (
    "This is a hookscope activation store, not a datasets folder - read it with "
    "hookscope.open_store(DIR), "
    "or convert it with hookscope export DIR --format hf --out NEW_DIR"
)

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
    """The card's bytes (the writer puts them unless the store already has a card)."""
    return _TEXT.encode("utf-8")
