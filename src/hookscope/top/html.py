# ruff: noqa: E501  (the page template below is HTML/JS/CSS, wrapped as its own language reads best)
"""One self-contained HTML page for a point (or an SAE): every unit's histogram and top contexts.

No network: the data is one JSON block inside the page, the script and style are inline, the
histogram is SVG drawn by the script. Token text is put in with `textContent`, never parsed as
HTML. The page opens on the unit named in the address (`page.html#unit=12`) or the first one.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..atomic_files import write_atomic
from ..errors import StoreError
from ..progress import RowsBar
from .contexts import Gatherer, build_contexts
from .encoders import Encoder
from .index import TopIndex, hist_edges

if TYPE_CHECKING:  # the store room is below this one; a Store is passed in, never imported
    from ..store import Store

MAX_UNITS = 4096  # a page for more units than this gets too big to open; choose some with `units`
_UNIT_BATCH = 64  # units whose contexts are built at once


def page_data(
    store: Store,
    index: TopIndex,
    encoder: Encoder,
    *,
    units: Sequence[int] | None = None,
    k: int = 20,
    context: int = 8,
    tokenizer: Any = None,
    progress: bool = False,
) -> dict[str, Any]:
    units = list(range(index.units)) if units is None else [int(u) for u in units]
    bad = [u for u in units if not 0 <= u < index.units]
    if bad:
        raise StoreError(f"unit {bad[0]} is out of range: the index has units 0..{index.units - 1}")
    if len(units) > MAX_UNITS:
        raise StoreError(
            f"{len(units)} units is too many for one page (at most {MAX_UNITS}); choose some, "
            "e.g. --units 0:1024"
        )
    k = min(k, index.k)
    strings: dict[str, int] = {}

    def sid(s: str) -> int:
        return strings.setdefault(s, len(strings))

    gather = Gatherer(store, index.info["point"])
    out_units = []
    bar = RowsBar("contexts", total=len(units), unit="unit") if progress else None
    for b in range(0, len(units), _UNIT_BATCH):
        batch = units[b : b + _UNIT_BATCH]
        sel = list(batch)
        ctxs = build_contexts(
            store,
            index.info["point"],
            encoder,
            sel,
            index.rows[sel, :k],
            index.values[sel, :k],
            context=context,
            tokenizer=tokenizer,
            gather=gather,
        )
        for u, cs in zip(batch, ctxs, strict=True):
            out_units.append(
                {
                    "u": u,
                    "freq": float(index.fires[u]) / max(index.total_rows, 1),
                    "fires": int(index.fires[u]),
                    "max": _num(float(index.values[u, 0])) if index.k else None,
                    "hist": index.hist[u].tolist(),
                    "ctx": [
                        {
                            "v": _num(c.value),
                            "c": c.center,
                            "row": c.row,
                            "doc": c.doc_id,
                            "pos": c.position,
                            "t": [sid(p) for p in (c.pieces or [f"<{t}>" for t in c.token_ids])],
                            "a": [_num(round(a, 5)) for a in c.values],
                        }
                        for c in cs
                    ],
                }
            )
        if bar is not None:
            bar.update(len(batch))
    if bar is not None:
        bar.close()
    edges = hist_edges()
    return {
        "point": index.info["point"],
        "source": index.info["source"],
        "rows": index.total_rows,
        "k": k,
        "context": context,
        "units": out_units,
        "strings": list(strings),
        "edges": [None if math.isinf(e) else e for e in edges],
        "store": str(store.path),
        "settings": {key: store.manifest.settings.get(key) for key in ("model", "data")},
    }


def _num(x: float) -> float | None:
    return None if math.isnan(x) or math.isinf(x) else x


def write_page(path: str | os.PathLike, data: dict[str, Any]) -> Path:
    path = Path(path)
    blob = json.dumps(data, separators=(",", ":"), allow_nan=False)
    blob = (
        blob.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    )  # safe inside <script>
    title = f"hookscope top: {data['point']}" + (" (SAE)" if data["source"].get("kind") == "sae" else "")
    html = _PAGE.replace("__TITLE__", _escape(title)).replace("__DATA__", blob)
    try:
        write_atomic(path, html.encode("utf-8"))
    except OSError as e:
        raise StoreError(f"cannot write the page {path}: {e}") from e
    return path


def _escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


_PAGE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:">
<title>__TITLE__</title>
<style>
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1d2430;background:#f6f7f9}
header{padding:10px 16px;background:#1d2430;color:#fff}
header h1{font-size:16px;margin:0}
header .sub{font-size:12px;color:#b8c0cc}
main{display:flex;height:calc(100vh - 58px)}
#side{width:270px;border-right:1px solid #d5d9e0;display:flex;flex-direction:column;background:#fff}
#controls{padding:8px;border-bottom:1px solid #e3e6eb;display:flex;gap:6px;flex-wrap:wrap}
#controls select,#controls input{font:inherit;padding:2px 4px}
#units{overflow-y:auto;flex:1}
.unit{display:flex;justify-content:space-between;padding:3px 10px;cursor:pointer;font-variant-numeric:tabular-nums;
 border-bottom:1px solid #f0f1f4}
.unit:hover{background:#eef3fb}
.unit.sel{background:#d8e6fb;font-weight:600}
.unit .m{color:#5b6472;font-size:12px}
#detail{flex:1;overflow-y:auto;padding:12px 18px}
#detail h2{font-size:18px;margin:4px 0}
.stats{color:#4a5361;margin-bottom:6px}
#hist svg{background:#fff;border:1px solid #e3e6eb}
.ctxs{margin-top:10px}
.ctx{display:flex;gap:10px;align-items:baseline;background:#fff;border:1px solid #e3e6eb;border-radius:4px;
 padding:4px 8px;margin:3px 0}
.ctx .v{width:70px;text-align:right;font-variant-numeric:tabular-nums;color:#333;flex:none}
.ctx .toks{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:13px;white-space:pre-wrap;word-break:break-word}
.tok{border-radius:2px}
.tok.center{outline:2px solid #c0392b;outline-offset:0}
.where{color:#8a93a0;font-size:11px;flex:none}
</style></head>
<body>
<header><h1 id="title"></h1><div class="sub" id="sub"></div></header>
<main>
<div id="side"><div id="controls">
<label>sort <select id="sort"><option value="unit">unit</option><option value="max">max</option>
<option value="freq">frequency</option></select></label>
<select id="dir"><option value="desc">high first</option><option value="asc">low first</option></select>
<input id="goto" type="number" min="0" placeholder="unit #" style="width:70px">
</div><div id="units"></div></div>
<div id="detail"><h2 id="unit-title"></h2><div class="stats" id="stats"></div><div id="hist"></div>
<div class="ctxs" id="contexts"></div></div>
</main>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const S = D.strings;
const byUnit = new Map(D.units.map(u => [u.u, u]));
const sae = D.source && D.source.kind === "sae";
const kind = sae ? "feature" : "unit";
let current = null;
function el(tag, cls, text) { const e = document.createElement(tag); if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text; return e; }
function fmt(x) { return x === null || x === undefined ? "-" : (Math.abs(x) >= 1000 || (x !== 0 && Math.abs(x) < 0.001)
  ? x.toExponential(2) : x.toFixed(3)); }
function pct(f) { return (100 * f).toPrecision(3) + "%"; }
document.getElementById("title").textContent = document.title;
document.getElementById("sub").textContent = D.rows.toLocaleString() + " rows of " + D.store +
  (D.settings.model ? " (model " + D.settings.model + ")" : "") + (sae ? "; SAE " + D.source.path : "");
function sortedUnits() {
  const key = document.getElementById("sort").value, dir = document.getElementById("dir").value === "asc" ? 1 : -1;
  const us = D.units.slice();
  if (key === "unit") us.sort((a, b) => a.u - b.u);
  else us.sort((a, b) => dir * (((a[key] ?? -Infinity) - (b[key] ?? -Infinity)) || (a.u - b.u) * dir));
  return us;
}
function renderList() {
  const box = document.getElementById("units"); box.textContent = "";
  for (const u of sortedUnits()) {
    const row = el("div", "unit" + (u.u === current ? " sel" : "")); row.dataset.unit = u.u;
    row.append(el("span", null, kind + " " + u.u), el("span", "m", "max " + fmt(u.max) + " \u00b7 " + pct(u.freq)));
    row.addEventListener("click", () => select(u.u));
    box.append(row);
  }
}
function shade(a, max) {
  if (a === null || !(max > 0)) return "transparent";
  const t = Math.max(-1, Math.min(1, a / max));
  return t >= 0 ? "rgba(230,120,20," + (0.85 * t).toFixed(3) + ")" : "rgba(40,110,220," + (-0.6 * t).toFixed(3) + ")";
}
function histSvg(u) {
  const NS = "http://www.w3.org/2000/svg", W = 640, H = 150, pad = 22;
  const svg = document.createElementNS(NS, "svg"); svg.setAttribute("width", W); svg.setAttribute("height", H + pad);
  let lo = u.hist.findIndex(c => c > 0), hi = u.hist.length - 1 - u.hist.slice().reverse().findIndex(c => c > 0);
  if (lo < 0) { lo = 0; hi = u.hist.length - 1; }
  const n = hi - lo + 1, bw = (W - 2 * pad) / n, top = Math.max(...u.hist.slice(lo, hi + 1), 1);
  for (let i = lo; i <= hi; i++) {
    const c = u.hist[i], h = c > 0 ? Math.max(1, (H - 10) * Math.log1p(c) / Math.log1p(top)) : 0;
    const r = document.createElementNS(NS, "rect");
    r.setAttribute("x", pad + (i - lo) * bw); r.setAttribute("y", H - h); r.setAttribute("width", Math.max(bw - 1, 1));
    r.setAttribute("height", h); r.setAttribute("fill", i > 40 ? "#e67814" : i < 40 ? "#286edc" : "#9aa3af");
    const a = D.edges[i], b = D.edges[i + 1];
    const t = document.createElementNS(NS, "title");
    t.textContent = "[" + (a === null ? "-inf" : fmt(a)) + ", " + (b === null ? "inf" : fmt(b)) + "): " + c.toLocaleString();
    r.append(t); svg.append(r);
  }
  for (const [i, anchor] of [[lo, "start"], [hi + 1, "end"]]) {
    const e = D.edges[i], tx = document.createElementNS(NS, "text");
    tx.setAttribute("x", pad + (i - lo) * bw); tx.setAttribute("y", H + 15); tx.setAttribute("font-size", "11");
    tx.setAttribute("text-anchor", anchor); tx.textContent = e === null ? (i === 0 ? "-inf" : "inf") : fmt(e);
    svg.append(tx);
  }
  return svg;
}
function select(unit) {
  const u = byUnit.get(unit); if (!u) return;
  current = unit;
  if (location.hash !== "#unit=" + unit) history.replaceState(null, "", "#unit=" + unit);
  document.getElementById("unit-title").textContent = D.point + " \u2014 " + kind + " " + unit;
  document.getElementById("stats").textContent = "max " + fmt(u.max) + " \u00b7 fires (> 0) on " +
    u.fires.toLocaleString() + " of " + D.rows.toLocaleString() + " rows (" + pct(u.freq) + ")";
  const hist = document.getElementById("hist"); hist.textContent = "";
  hist.append(el("div", "stats", "histogram of values (log-spaced bins, 2 per octave; bar height log count; " +
    "orange > 0, blue < 0, grey |x| < 2^-10)"), histSvg(u));
  const box = document.getElementById("contexts"); box.textContent = "";
  box.append(el("div", "stats", "top " + u.ctx.length + " contexts (token of interest outlined, shaded by value)"));
  for (const c of u.ctx) {
    const row = el("div", "ctx"); row.dataset.row = c.row;
    row.append(el("span", "v", fmt(c.v)));
    const toks = el("span", "toks");
    c.t.forEach((s, i) => {
      const sp = el("span", "tok" + (i === c.c ? " center" : ""), S[s]);
      sp.style.background = shade(c.a[i], u.max); sp.title = fmt(c.a[i]);
      toks.append(sp);
    });
    row.append(toks, el("span", "where", c.doc !== null ? "doc " + c.doc + " pos " + c.pos : "row " + c.row));
    box.append(row);
  }
  for (const r of document.querySelectorAll(".unit")) r.classList.toggle("sel", Number(r.dataset.unit) === unit);
}
function fromHash() { const m = /unit=(\d+)/.exec(location.hash); return m ? Number(m[1]) : null; }
for (const id of ["sort", "dir"]) document.getElementById(id).addEventListener("change", renderList);
document.getElementById("goto").addEventListener("change", e => select(Number(e.target.value)));
window.addEventListener("hashchange", () => { const u = fromHash(); if (u !== null && u !== current) select(u); });
renderList();
const start = fromHash();
select(start !== null && byUnit.has(start) ? start : (D.units.length ? D.units[0].u : null));
</script></body></html>
"""
