"""`top(store, point, unit)`: the top-activating contexts of one unit, from the saved index."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import StoreError
from .contexts import Context, build_contexts
from .encoders import Encoder, load_encoder, neurons
from .index import DEFAULT_INDEX_K, TopIndex, check_point, hist_edges
from .render import context_line
from .saved import get_index

if TYPE_CHECKING:  # the store room is below this one; a Store is passed in, never imported
    from ..store import Store


@dataclass
class TopResult:
    """The top contexts of `unit` of `point` (a raw unit, or an SAE feature when `source` says so)."""

    point: str
    unit: int
    source: dict[str, Any]
    values: torch.Tensor  # [k] best first
    rows: torch.Tensor  # [k] global store rows
    contexts: list[Context]
    fires: int
    total_rows: int
    hist: torch.Tensor  # [81], see hookscope.top.index for the bins

    @property
    def frequency(self) -> float:
        return self.fires / max(self.total_rows, 1)

    @property
    def hist_edges(self) -> list[float]:
        return hist_edges()

    def __str__(self) -> str:
        """The terminal view: a line for the unit, then one per context, the value first."""
        kind = "SAE feature" if self.source.get("kind") == "sae" else "unit"
        top = float(self.values[0]) if len(self.values) else float("nan")
        lines = [
            f"{self.point} {kind} {self.unit}: fires (> 0) on {self.fires:,} of {self.total_rows:,} "
            f"rows ({100 * self.frequency:.3g}%), max {top:.4g}"
        ]
        for i, ctx in enumerate(self.contexts):
            where = f"doc {ctx.doc_id} pos {ctx.position}" if ctx.doc_id is not None else f"row {ctx.row}"
            lines.append(f"{i + 1:>3}. {ctx.value:>9.4g}  {context_line(ctx)}   ({where})")
        return "\n".join(lines)


def resolve_encoder(store: Store, point: str, sae: str | os.PathLike | Encoder | None) -> Encoder:
    if isinstance(sae, Encoder):
        return sae
    if sae is None:
        return neurons(check_point(store, point))
    return load_encoder(Path(sae))


def top(
    store: Store,
    point: str,
    unit: int,
    *,
    k: int = 20,
    context: int = 8,
    sae: str | os.PathLike | Encoder | None = None,
    tokenizer: Any = None,
    rebuild: bool = False,
    index_k: int | None = None,
    progress: bool = False,
    cache_dir: str | os.PathLike | None = None,
) -> TopResult:
    """The k rows where `unit` of `point` (or SAE feature `unit`, with `sae`) is largest, each with
    `context` tokens on either side, decoded with `tokenizer` when given. The first call builds the
    index of every unit of the point in one pass and saves it beside the store (in `cache_dir`, or
    a local cache when the store cannot be written: top/saved.py); later calls read it.

    Returns:
        TopResult: `values` and `rows` best first, `contexts` (tokens and values around each row,
            the row's token at `center`), `fires` / `frequency` and a histogram of the unit.

    Raises:
        StoreError: a point the store lacks, a unit out of range, k < 1, no `token_ids` column, or
            a saved index that no longer matches the store (`rebuild=True` builds it again)."""
    encoder = resolve_encoder(store, point, sae)
    if not 0 <= unit < encoder.units:
        shape = list(store.points[point].shape)
        what = "features" if encoder.kind == "sae" else f"units (per-row shape {shape})"
        raise StoreError(
            f"unit {unit} is out of range: {point!r} has {encoder.units} {what}; give 0..{encoder.units - 1}"
        )
    if k < 1:
        raise StoreError(f"k={k}: give k >= 1")
    index = get_index(
        store,
        point,
        encoder=encoder,
        k=max(k, index_k or DEFAULT_INDEX_K),
        rebuild=rebuild,
        progress=progress,
        cache_dir=cache_dir,
    )
    return result_for(store, index, encoder, unit, k=k, context=context, tokenizer=tokenizer)


def result_for(
    store: Store, index: TopIndex, encoder: Encoder, unit: int, *, k: int, context: int, tokenizer: Any = None
) -> TopResult:
    k = min(k, index.k)
    rows, values = index.rows[unit : unit + 1, :k], index.values[unit : unit + 1, :k]
    contexts = build_contexts(
        store, index.info["point"], encoder, [unit], rows, values, context=context, tokenizer=tokenizer
    )[0]
    return TopResult(
        index.info["point"],
        unit,
        index.info["source"],
        values[0],
        rows[0],
        contexts,
        int(index.fires[unit]),
        index.total_rows,
        index.hist[unit],
    )
