"""The input embedding looked up from its weight file while block streaming (`EmbeddingRows`).

Every streamed pass runs the model's own forward, so every pass looks up its tokens' embeddings;
kept resident, the table is often the largest weight a streamer holds (a 32,000 x 1,024 table is
65.5 MB in bfloat16, as much as three blocks of the bench's Llama shape), and a memory-mapped one
keeps the pages of every row it has used. Here the table's parameter stays on `meta` and each lookup
reads the rows its tokens name (`read_rows`: a `pread` per run of consecutive rows, converted to
the compute dtype as `Tensor.to` converts): a batch's rows are resident, only while the pass runs.
A lookup is a copy and a conversion works value by value, so the rows are the converted table's
bit for bit. Taken only on the CPU (on a GPU the table lives in device memory, and a pass is too
short to wait on reads: the next block is only ~ms away), for a plain `nn.Embedding` read straight
from a safetensors file (no tied head, no fused or split weight, no `max_norm`, which rewrites the
table).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from .safetensors_reads import TensorRead, read_rows

_STAGING_BYTES = 2**18  # a conversion's stored bytes, a slice at a time


class EmbeddingRows:
    """`module`'s lookups read from `read` (its weight stays on `meta`) once `install`ed."""

    def __init__(self, module: nn.Embedding, read: TensorRead):
        self.module, self.read = module, read
        self.dtype = module.weight.dtype
        self._staging = torch.empty(_STAGING_BYTES, dtype=torch.uint8)

    def install(self) -> None:
        self.module.forward = self.lookup

    def lookup(self, ids: Tensor) -> Tensor:
        """What `nn.Embedding.forward(ids)` gives with the (converted) table in memory."""
        flat = ids.reshape(-1).to("cpu")
        count = self.module.num_embeddings
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= count):
            raise IndexError(f"a token id outside the embedding's {count} rows (the model's vocabulary)")
        unique, where = torch.unique(flat, sorted=True, return_inverse=True)
        rows = torch.empty(unique.numel(), self.module.embedding_dim, dtype=self.dtype)
        read_rows(self.read, unique.tolist(), rows, self._staging)
        return rows[where].reshape(*ids.shape, self.module.embedding_dim)


def embedding_rows_for(
    model: nn.Module, locate: Callable[[str], TensorRead | None], device: torch.device | str
) -> tuple[str, EmbeddingRows] | None:
    """The input embedding's weight name and its row reader, when it can be read by rows: on the
    CPU, a plain `nn.Embedding` whose weight `locate` finds in a safetensors file."""
    if torch.device(device).type != "cpu":
        return None
    try:
        module = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if type(module) is not nn.Embedding or module.max_norm is not None:
        return None
    name = next(
        (f"{path}.weight" if path else "weight" for path, m in model.named_modules() if m is module), None
    )
    read = locate(name) if name else None
    if read is None:
        return None
    return name, EmbeddingRows(module, read)
