"""The terminal view of a unit's top contexts: one line per context, the token of interest in
[[double brackets]], the value first."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .query import TopResult


def _clean(piece: str) -> str:
    return piece.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")


def context_line(ctx, *, marker: tuple[str, str] = ("[[", "]]")) -> str:
    if ctx.pieces is not None:
        pieces = [_clean(p) for p in ctx.pieces]
    else:  # no tokenizer: token ids
        pieces = [f" {t}" for t in ctx.token_ids]
    left, right = marker
    c = ctx.center
    stripped = pieces[c].lstrip()  # keep the token's leading space outside the marker
    pieces[c] = pieces[c][:len(pieces[c]) - len(stripped)] + left + stripped + right
    return "".join(pieces).strip()


def text_report(result: TopResult) -> str:
    kind = "SAE feature" if result.source.get("kind") == "sae" else "unit"
    top = float(result.values[0]) if len(result.values) else float("nan")
    lines = [f"{result.point} {kind} {result.unit}: fires (> 0) on {result.fires:,} of {result.total_rows:,} "
             f"rows ({100 * result.frequency:.3g}%), max {top:.4g}"]
    for i, ctx in enumerate(result.contexts):
        where = f"doc {ctx.doc_id} pos {ctx.position}" if ctx.doc_id is not None else f"row {ctx.row}"
        lines.append(f"{i + 1:>3}. {ctx.value:>9.4g}  {context_line(ctx)}   ({where})")
    return "\n".join(lines)
