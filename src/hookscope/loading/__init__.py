"""Loading a model, in one direction: each file imports only the ones above it in this list.

- `weight_files.py`: where a model's files are (the bundled default, a directory, a hub id) and
  its weight files;
- `safetensors_reads.py`: a safetensors tensor read by its byte range, straight into a buffer;
- `checkpoint.py`: `Checkpoint`, the weight files read per tensor through transformers' loader;
- `partial_load.py`: what a `points=` load materializes (`PartialLoad`) and its guard;
- `tokenizer.py`: a model's tokenizer and the hashes a store records;
- `loader.py`: `load` and the `Loaded` it returns;
- `block_buffers.py`: reused weight buffers for block streaming;
- `stream_plan.py`: what streaming keeps resident under `max_memory` (`plan_stream`, `parse_size`);
- `streamer.py`: `BlockStreamer`, one block at a time, on top of all the above.
"""

from .loader import Loaded, load
from .stream_plan import parse_size
from .streamer import streamer_for
from .tokenizer import load_tokenizer, sha256_text, tokenizer_hash
from .weight_files import DEFAULT_MODEL, resolve_source

__all__ = ["DEFAULT_MODEL", "Loaded", "load", "load_tokenizer", "parse_size", "resolve_source", "sha256_text",
           "streamer_for", "tokenizer_hash"]
