"""Why a store whose points changed meaning cannot be resumed, in words.

A source records, in its settings, the meaning of each stored point whose meaning changed in this
hookscope (`point_meanings`: point -> {"means": now, "before": earlier}; sources/identity.py). A
store written before the change lacks the record, so its settings hash differs and resume.py
refuses it; this says which points, what they held then, what they mean now, and what to do. The
store still opens for reading: its rows are what they always were.
"""

from __future__ import annotations

from typing import Any

KEY = "point_meanings"


def changed_meanings(stored: dict[str, Any], wanted: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """point -> (what the store holds, what the name means now), where the two differ."""
    then, now = stored.get(KEY) or {}, wanted.get(KEY) or {}
    out = {}
    for point in sorted(set(then) | set(now)):
        held = then.get(point, {}).get("means") or now.get(point, {}).get("before")
        means = now.get(point, {}).get("means") or then.get(point, {}).get("before")
        if held != means and point in stored.get("points", []):
            out[point] = (held or "its earlier meaning", means or "another meaning")
    return out


def refusal(stored: dict[str, Any], wanted: dict[str, Any], where: str) -> str | None:
    """The message refusing to resume `where` when its points' meanings changed, else None."""
    changed = changed_meanings(stored, wanted)
    if not changed:
        return None
    lines = "\n".join(
        f"  {point}: this store holds {held}; hookscope now writes {means}"
        for point, (held, means) in changed.items()
    )
    return (
        f"{where} cannot be resumed: a point it holds changed meaning since it was written, so new "
        f"rows would not match its old ones:\n{lines}\nIt still opens for reading (hs.open_store), "
        f"and its rows keep their old meaning. To extend it, extract into a new --out directory "
        f"(the old meaning is reachable under the names above, e.g. *.out_pre_norm, *.out_pre_scale)."
    )
