"""docs/img/architecture.svg, drawn from the import contract in pyproject.toml (`[tool.importlinter]`,
its one copy) and the imports the code makes: a row per layer of the contract (the lowest at the top,
since arrows point up to the room imported), a box per room, an arrow per room-to-room import found
in the code. The top layer (`cli/`, which may import every room) is one arrow to a bar beside all
the rooms below. Every arrow carries `data-from` / `data-to`, which tests/core/test_architecture.py
reads back and compares with the code.

    python tests/core/architecture_picture.py      # rewrite docs/img/architecture.svg after a change
"""

from __future__ import annotations

import sys
import tomllib
from html import escape
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_architecture import GRAPH, ROOT, room_of  # noqa: E402

PICTURE = ROOT / "docs" / "img" / "architecture.svg"
EVERYTHING = "*"  # the arrow target of the top layer, which may import every room below it

BOX_W, BOX_H, GAP_X, ROW_H, MARGIN, LEFT = 132, 30, 22, 64, 16, 90


def contract_layers() -> list[list[str]]:
    """The rooms of the layers contract over `hookscope`, lowest layer first."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contract = next(
        c for c in config["contracts"] if c["type"] == "layers" and c["containers"] == ["hookscope"]
    )
    return [[r.strip() for r in layer.split("|")] for layer in reversed(contract["layers"])]


def room_imports() -> dict[str, set[str]]:
    """Room -> the other rooms its modules import (the package's own `__init__` left out)."""
    found: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        room = room_of(module)
        found.setdefault(room, set()).update(room_of(t) for t in targets if room_of(t) != room)
    return {r: {t for t in ts if t != "__init__"} for r, ts in found.items() if r != "__init__"}


def arrange(rows: list[list[str]], table: dict[str, set[str]]) -> list[list[str]]:
    """Each row ordered to keep arrows short (a few barycentre sweeps)."""
    rows = [list(r) for r in rows]
    for _ in range(4):
        place = {r: i / max(len(rr), 1) for rr in rows for i, r in enumerate(rr)}
        for rr in rows[1:]:
            rr.sort(key=lambda r: (sum(place[d] for d in table[r]) / len(table[r])) if table.get(r) else 0.5)
            place |= {r: i / max(len(rr), 1) for i, r in enumerate(rr)}
    return rows


def edges(rows: list[list[str]], table: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) for each room-to-room import; the top layer's as one (room, "*")."""
    top = set(rows[-1])
    out = []
    for room in (r for rr in rows for r in rr):
        out += [(room, EVERYTHING)] if room in top else [(room, d) for d in sorted(table.get(room, ()))]
    return out


def draw(layer_rows: list[list[str]], table: dict[str, set[str]]) -> str:
    rows = arrange(layer_rows, table)
    rooms = [r for rr in rows for r in rr]
    width = max(len(r) for r in rows) * (BOX_W + GAP_X) - GAP_X + MARGIN + LEFT
    height = len(rows) * ROW_H + 2 * MARGIN
    xy: dict[str, tuple[float, float]] = {}
    for i, rr in enumerate(rows):
        span = len(rr) * (BOX_W + GAP_X) - GAP_X
        for j, room in enumerate(rr):
            xy[room] = (LEFT + (width - LEFT - MARGIN - span) / 2 + j * (BOX_W + GAP_X), MARGIN + i * ROW_H)
    bars = {room: MARGIN + 14 * k for k, room in enumerate(rows[-1])}
    out_of = {
        room: sorted(
            (t for f, t in edges(rows, table) if f == room), key=lambda t: xy[t][0] if t in xy else width / 2
        )
        for room in rooms
    }
    into = {
        room: sorted((f for f, t in edges(rows, table) if t == room), key=lambda f: xy[f][0])
        for room in rooms
    }

    def port(room: str, others: list[str], other: str) -> float:
        k = others.index(other)
        return xy[room][0] + BOX_W * (k + 1) / (len(others) + 1)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="sans-serif" font-size="12">',
        "<title>hookscope's rooms and the one-way imports between them</title>",
        '<defs><marker id="head" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="6" markerHeight="6" '
        'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#5c6bc0"/></marker></defs>',
    ]
    if bars:
        mid = (MARGIN + max(xy[r][1] for r in bars) - ROW_H) / 2
        parts.append(
            f'<text transform="translate({max(bars.values()) + 16} {mid:.0f}) rotate(-90)" '
            'text-anchor="middle" fill="#616161">every room above</text>'
        )
    for room, x in bars.items():  # the rooms above `room`, which it may all import
        parts.append(
            f'<path d="M{x + 5} {MARGIN} H{x} V{xy[room][1] - ROW_H + BOX_H} H{x + 5}" fill="none" '
            f'stroke="#9e9e9e"><title>every room above {room}</title></path>'
        )
    for room, target in edges(rows, table):
        if target == EVERYTHING:  # left, to its bar
            x1, y1 = xy[room][0], xy[room][1] + BOX_H / 2
            x2 = bars[room]
            path = (
                f"M{x1:.1f} {y1:.1f} H{x2 + 8:.1f} Q{x2:.1f} {y1:.1f} {x2:.1f} {y1 - 8:.1f} "
                f"V{xy[room][1] - ROW_H + BOX_H + 2:.1f}"
            )
        else:
            x1, y1 = port(room, out_of[room], target), xy[room][1]
            x2, y2 = port(target, into[target], room), xy[target][1] + BOX_H
            bend = max((y1 - y2) / 2, 12)
            path = f"M{x1:.1f} {y1:.1f} C{x1:.1f} {y1 - bend:.1f} {x2:.1f} {y2 + bend:.1f} {x2:.1f} {y2:.1f}"
        parts.append(
            f'<path class="edge" data-from="{room}" data-to="{target}" d="{path}" '
            'fill="none" stroke="#5c6bc0" stroke-opacity="0.45" marker-end="url(#head)">'
            f"<title>{room} imports {'every room above' if target == EVERYTHING else target}</title>"
            "</path>"
        )
    for room, (x, y) in xy.items():
        package = (ROOT / "src" / "hookscope" / room).is_dir()
        label = room + ("/" if package else ".py")
        parts.append(
            f'<g class="room" data-room="{room}"><rect x="{x:.1f}" y="{y:.1f}" width="{BOX_W}" '
            f'height="{BOX_H}" rx="5" fill="#e8eaf6" stroke="#3949ab"/>'
            f'<text x="{x + BOX_W / 2:.1f}" y="{y + BOX_H / 2 + 4:.1f}" text-anchor="middle">'
            f"{escape(label)}</text></g>"
        )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def current() -> str:
    """The picture the contract and the code draw now."""
    return draw(contract_layers(), room_imports())


if __name__ == "__main__":
    PICTURE.write_text(current())
    print(f"wrote {PICTURE}")
