"""The activation store: safetensors shards + an atomic manifest (see docs/store-format.md)."""

from .dataset import ActivationDataset
from .manifest import Column, Manifest, ShardEntry, settings_hash
from .planning import DatasetOptions
from .reader import Store, open_store
from .resume import merge_rank_manifests
from .stats import PointStats
from .writer import ShardWriter

__all__ = [
    "ActivationDataset",
    "Column",
    "DatasetOptions",
    "Manifest",
    "PointStats",
    "ShardEntry",
    "ShardWriter",
    "Store",
    "merge_rank_manifests",
    "open_store",
    "settings_hash",
]
