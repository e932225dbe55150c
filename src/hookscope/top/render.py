"""One top context as a line of the terminal view (`str(TopResult)`): its tokens, the token of
interest in [[double brackets]]."""

from __future__ import annotations


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
    pieces[c] = pieces[c][: len(pieces[c]) - len(stripped)] + left + stripped + right
    return "".join(pieces).strip()
