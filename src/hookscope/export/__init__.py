"""From a store to other trainers' inputs (imports only `store`).

- `export_hf(store, OUT)`: a Hugging Face `datasets` folder, one example per row (token);
  `to_hf_dataset(store)` writes one into a cache once and returns it loaded.
- `export_saelens(store, OUT)`: SAELens's cached-activations folder, one example per sequence,
  the column named after the TransformerLens hook; `saelens_config(OUT)` reads its metadata back.

Both write once, straight from the shards (no `datasets` cache in between); `hookscope export
STORE --format hf|saelens --out DIR` runs them from the command line. Trainers that take an
iterator of batches (SAELens's `SAETrainer`, dictionary_learning's `trainSAE`, a sparsify
`SparseCoder` loop) need no export: `iter(store.dataset(point, batch_size=B, repeat=True))`.
"""

from .arrow import SIDECAR
from .hf import export_hf, to_hf_dataset
from .saelens import SaelensExport, export_saelens, saelens_config, tl_hook_name

__all__ = [
    "SIDECAR",
    "SaelensExport",
    "export_hf",
    "export_saelens",
    "saelens_config",
    "tl_hook_name",
    "to_hf_dataset",
]
