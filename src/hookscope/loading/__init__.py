"""Loading a model, in one direction: where its files are (`weight_files`) -> a safetensors tensor read
by its bytes (`safetensors_reads`) -> the checkpoint read per tensor (`checkpoint`) -> what a
`points=` load materializes (`partial_load`) -> the tokenizer (`tokenizer`) -> `load` (`loader`) ->
block streaming on top (`block_buffers`, `stream_plan`, `streamer`). Each file imports only those
before it: the order of this room's row in docs/architecture.md, which tests/core/test_architecture.py
checks. Here: the names the other rooms use.
"""

from .loader import Loaded, load
from .stream_plan import parse_size
from .streamer import streamer_for
from .tokenizer import load_tokenizer, sha256_text, tokenizer_hash
from .weight_files import DEFAULT_MODEL, resolve_source

__all__ = [
    "DEFAULT_MODEL",
    "Loaded",
    "load",
    "load_tokenizer",
    "parse_size",
    "resolve_source",
    "sha256_text",
    "streamer_for",
    "tokenizer_hash",
]
