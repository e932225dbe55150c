"""What does this unit respond to: the top-activating contexts of every unit of a store's point
(raw units, or the features of a sparse autoencoder), from one pass over the store.

    index.py     the one-pass top-k index (values, rows, histogram, firing count per unit)
    saved.py     where it is kept (beside the store, or a local cache) and reading it back, refused
                 once the store changes
    encoders.py  raw units, or SAE features (SAELens directory, or a plain encoder file)
    contexts.py  rows -> the tokens around them, decoded with a tokenizer given by the caller
    query.py     top(store, point, unit): one unit's answer
    render.py    the terminal view; html.py the self-contained page

This room imports only the store (its filesystem, for the index; it never loads a model or a
tokenizer: the caller passes one). `hookscope.top(store, point, unit)` is its entry point.
"""

from ..errors import SAEError, StaleIndexError
from .contexts import Context
from .encoders import Encoder, load_encoder, neurons
from .html import page_data, write_page
from .index import DEFAULT_INDEX_K, TopIndex, build_index, hist_edges
from .query import TopResult, resolve_encoder, top
from .saved import default_cache_dir, get_index, index_path, load_index

__all__ = [
    "DEFAULT_INDEX_K",
    "Context",
    "Encoder",
    "SAEError",
    "StaleIndexError",
    "TopIndex",
    "TopResult",
    "build_index",
    "default_cache_dir",
    "get_index",
    "hist_edges",
    "index_path",
    "load_encoder",
    "load_index",
    "neurons",
    "page_data",
    "resolve_encoder",
    "top",
    "write_page",
]
