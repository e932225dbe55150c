"""docs/img/architecture.svg, drawn from the import table of docs/architecture.md (its one copy):
a box per room, a row per layer (a room sits one row below the lowest row it imports from), an
arrow per import the table allows, pointing up to the room imported. `everything` is one arrow to
a bar at the left beside all the rooms above. Every arrow carries `data-from` / `data-to`, which
tests/core/test_architecture.py reads back and compares with the table.

    python tests/core/architecture_picture.py      # rewrite docs/img/architecture.svg after a table change
"""

from __future__ import annotations

import sys
from html import escape
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_architecture import ARCHITECTURE_MD, read_table  # noqa: E402

PICTURE = ARCHITECTURE_MD.parent / "img" / "architecture.svg"
EVERYTHING = "*"  # the arrow target of a row that may import every room above it

BOX_W, BOX_H, GAP_X, ROW_H, MARGIN, LEFT = 132, 30, 22, 64, 16, 90


def layers(table: dict[str, set[str]]) -> dict[str, int]:
    """Each room's row: 0 for a room importing none of ours, else one below its lowest import."""
    row: dict[str, int] = {}
    for room, imports in table.items():  # the table lists every import above its importer
        row[room] = 1 + max((row[r] for r in imports), default=-1)
    return row


def everything(table: dict[str, set[str]], room: str) -> bool:
    """A row whose last column says `everything`: it may import each room above it."""
    above = list(table)[: list(table).index(room)]
    return len(above) > 3 and table[room] == set(above)


def arrange(table: dict[str, set[str]]) -> list[list[str]]:
    """Rooms by row, each row ordered to keep arrows short (a few barycentre sweeps)."""
    row = layers(table)
    rows = [[r for r in table if row[r] == i] for i in range(max(row.values()) + 1)]
    for _ in range(4):
        place = {r: i / max(len(rr), 1) for rr in rows for i, r in enumerate(rr)}
        for rr in rows[1:]:
            rr.sort(key=lambda r: (sum(place[d] for d in table[r]) / len(table[r])) if table[r] else 0.5)
            place |= {r: i / max(len(rr), 1) for i, r in enumerate(rr)}
    return rows


def edges(table: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) for each import the table allows; `everything` as one (room, "*")."""
    out = []
    for room, imports in table.items():
        out += [(room, EVERYTHING)] if everything(table, room) else [(room, d) for d in sorted(imports)]
    return out


def draw(table: dict[str, set[str]]) -> str:
    rows = arrange(table)
    width = max(len(r) for r in rows) * (BOX_W + GAP_X) - GAP_X + MARGIN + LEFT
    height = len(rows) * ROW_H + 2 * MARGIN
    xy: dict[str, tuple[float, float]] = {}
    for i, rr in enumerate(rows):
        span = len(rr) * (BOX_W + GAP_X) - GAP_X
        for j, room in enumerate(rr):
            xy[room] = (LEFT + (width - LEFT - MARGIN - span) / 2 + j * (BOX_W + GAP_X), MARGIN + i * ROW_H)
    bars = {room: MARGIN + 14 * k for k, room in enumerate(r for r in table if everything(table, r))}
    out_of = {
        room: sorted(
            (t for f, t in edges(table) if f == room), key=lambda t: xy[t][0] if t in xy else width / 2
        )
        for room in table
    }
    into = {room: sorted((f for f, t in edges(table) if t == room), key=lambda f: xy[f][0]) for room in table}

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
    for room, target in edges(table):
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
        package = (ARCHITECTURE_MD.parents[1] / "src" / "hookscope" / room).is_dir()
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
    """The picture the table in docs/architecture.md draws now."""
    return draw(read_table(ARCHITECTURE_MD.read_text()))


if __name__ == "__main__":
    PICTURE.write_text(current())
    print(f"wrote {PICTURE}")
