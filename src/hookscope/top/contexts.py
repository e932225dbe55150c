"""From an index's top rows to readable contexts: the tokens around each row, in the same packed
sequence and document, with the unit's value on every one of them.

Every row of a store traces back to its token (`token_ids`), its packed sequence (`seq_ids`) and
document (`doc_ids`); rows of a sequence are consecutive in the store, so a row's context is its
neighbours `row - context .. row + context` that share its sequence and document. Decoding needs a
tokenizer (any object with `decode(ids)`, e.g. a Hugging Face tokenizer); this room never loads one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..errors import StoreError
from .encoders import Encoder

if TYPE_CHECKING:  # the store room is below this one; a Store is passed in, never imported
    from ..store import Store

_PAIR_CHUNK = 8192  # (row, unit) pairs evaluated at once for an SAE


@dataclass
class Context:
    """One top-activating row in its context. `token_ids[center]` is the token of interest."""

    row: int
    value: float
    token_ids: list[int]
    values: list[float]  # the unit's value on each token of the context
    center: int
    doc_id: int | None = None
    position: int | None = None  # of the token of interest in its document's tokenization
    text: str | None = None  # tokenizer.decode(token_ids)
    pieces: list[str] | None = None  # each token's share of `text` (they concatenate to it)

    def to_json(self) -> dict[str, Any]:
        return {
            "row": self.row,
            "value": self.value,
            "center": self.center,
            "doc": self.doc_id,
            "pos": self.position,
            "ids": self.token_ids,
            "values": self.values,
            "pieces": self.pieces,
        }


@dataclass
class Gatherer:
    """Reads columns of arbitrary global rows, a shard at a time (memory-mapped, loaded once each)."""

    store: Store
    point: str | None = None  # read together with the meta columns
    _shards: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.starts = torch.tensor([self.store.first_row(i) for i in range(self.store.num_shards + 1)])

    def _shard(self, i: int, name: str) -> torch.Tensor:
        cols = self._shards.get(i)
        if cols is None or name not in cols:
            # every column a query reads, in one checked open of the shard (not one per column)
            names = [n for n in ("token_ids", "doc_ids", "seq_ids", "positions") if n in self.store.meta]
            names += [self.point] if self.point is not None else []
            names += [n for n in (cols or {}) if n not in names]
            if name not in names:
                names.append(name)
            cols = self._shards[i] = self.store.load_shard(i, names)
        return cols[name]

    def column(self, name: str, rows: torch.Tensor, unit: torch.Tensor | None = None) -> torch.Tensor:
        """`name[rows]` (flattened per row), or `name[rows, unit]` element by element when `unit` is given."""
        rows = rows.reshape(-1)
        shard = torch.searchsorted(self.starts, rows, right=True) - 1
        out: torch.Tensor | None = None
        for i in shard.unique().tolist():
            sel = (shard == i).nonzero().squeeze(1)
            t = self._shard(i, name)
            t = t.reshape(t.shape[0], -1) if t.dim() > 1 else t
            local = rows[sel] - self.starts[i]
            part = t[local, unit.reshape(-1)[sel]] if unit is not None else t[local]
            if out is None:
                out = torch.empty((rows.shape[0], *part.shape[1:]), dtype=part.dtype)
            out[sel] = part
        if out is None:
            raise StoreError(f"{self.store.path}: no rows to read")
        return out


def unit_values_at(
    gather: Gatherer, point: str, encoder: Encoder, rows: torch.Tensor, units: torch.Tensor
) -> torch.Tensor:
    """The value of unit `units[j]` on global row `rows[j]`, as float32."""
    if encoder.kind == "neurons":
        return gather.column(point, rows, units).float()
    out = torch.empty(rows.shape[0])
    for s in range(0, rows.shape[0], _PAIR_CHUNK):
        x = gather.column(point, rows[s : s + _PAIR_CHUNK]).float()
        u = units[s : s + _PAIR_CHUNK]
        if encoder.topk is not None:  # whether a feature survives depends on the whole row
            out[s : s + _PAIR_CHUNK] = encoder.encode_units(x, None).gather(1, u[:, None]).squeeze(1)
            continue
        if encoder.b_dec is not None:
            x = x - encoder.b_dec
        pre = (x * encoder.W_enc.T[u]).sum(1) + encoder.b_enc[u]
        if encoder.scale is not None:
            pre = pre * encoder.scale[u]
        v = pre.relu()
        if encoder.threshold is not None:
            v = v * (pre > encoder.threshold[u])
        out[s : s + _PAIR_CHUNK] = v
    return out


def build_contexts(
    store: Store,
    point: str,
    encoder: Encoder,
    units: Sequence[int],
    rows: torch.Tensor,
    values: torch.Tensor,
    *,
    context: int = 8,
    tokenizer: Any = None,
    gather: Gatherer | None = None,
) -> list[list[Context]]:
    """Contexts of the top rows `rows` `[len(units), k]` (values `values`) of each of `units`."""
    if "token_ids" not in store.meta:
        raise StoreError(
            f"{store.path}: the store has no token_ids column, so its rows cannot be traced "
            "back to tokens (it was not written by hookscope extract)"
        )
    if context < 0:
        raise StoreError(f"context={context}: give 0 or more tokens on each side")
    gather = gather or Gatherer(store, point)
    n_units, k = rows.shape
    if k == 0 or n_units == 0:
        return [[] for _ in range(n_units)]
    span = torch.arange(-context, context + 1)
    window = rows[:, :, None] + span  # [U, k, W]
    inside = (window >= 0) & (window < len(store))
    clamped = window.clamp(0, max(len(store) - 1, 0))
    same = inside
    for name in ("seq_ids", "doc_ids"):
        if name in store.meta:
            col = gather.column(name, clamped).view(clamped.shape)
            same = same & (col == col[:, :, context : context + 1])
    ids = gather.column("token_ids", clamped).view(clamped.shape)
    unit_t = torch.as_tensor(list(units), dtype=torch.long)
    pair_rows = clamped[same]
    pair_units = unit_t[:, None, None].expand_as(clamped)[same]
    vals = torch.full(clamped.shape, float("nan"))
    vals[same] = unit_values_at(gather, point, encoder, pair_rows, pair_units)
    centers = rows.reshape(-1)
    doc = gather.column("doc_ids", centers).view(rows.shape) if "doc_ids" in store.meta else None
    pos = gather.column("positions", centers).view(rows.shape) if "positions" in store.meta else None
    decoder = _Decoder(tokenizer) if tokenizer is not None else None
    out: list[list[Context]] = []
    for u in range(n_units):
        ctxs = []
        for j in range(k):
            keep = same[u, j]
            first = int(keep.int().argmax())  # the kept tokens are one unbroken run around the center
            token_ids = ids[u, j][keep].tolist()
            token_vals = vals[u, j][keep].tolist()
            center = context - first
            token_vals[center] = float(values[u, j])  # the index's own value, bit for bit
            c = Context(
                int(rows[u, j]),
                float(values[u, j]),
                token_ids,
                token_vals,
                center,
                None if doc is None else int(doc[u, j]),
                None if pos is None else int(pos[u, j]),
            )
            if decoder is not None:
                c.text, c.pieces = decoder(token_ids)
            ctxs.append(c)
        out.append(ctxs)
    return out


class _Decoder:
    """Text of a token sequence and each token's share of it: piece i is what decoding the first
    i+1 tokens adds to decoding the first i (so pieces join into the tokenizer's own text where
    decoding is prefix-stable; otherwise a token decoded alone)."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def __call__(self, ids: list[int]) -> tuple[str, list[str]]:
        text = self.decode(ids)
        pieces, prev = [], ""
        for i in range(len(ids)):
            cur = self.decode(ids[: i + 1])
            if cur.startswith(prev):
                pieces.append(cur[len(prev) :])
            else:
                pieces.append(self.decode(ids[i : i + 1]))
            prev = cur
        return text, pieces
