"""The picture (PNG bar chart of time per block) and the self-contained HTML page.

The picture is SVG drawn here (no plotting package: it works on the base install); with
matplotlib installed (`pip install 'hookscope[plot]'`) a PNG of the same bars is written too,
drawn through matplotlib's object API with the Agg canvas, so the user's pyplot backend is never
switched.
"""

from __future__ import annotations

import html
import io
from typing import Any, Protocol

from .events import OpRow, Row
from .table import op_cells, op_header, row_cells, row_header


class Shown(Protocol):
    """What the picture and the page read of a profile: a `report.ProfileReport`, which calls this
    module to write them (so this module names its fields, not its class)."""

    model: str
    device: str
    backward: bool
    rows: list[Row]
    top_ops: list[OpRow]
    step_time_s: float
    profiled_step_s: float
    profiled_step_device_s: float | None
    hook_overhead: float | None
    step_time_without_hooks_s: float | None
    compile_stats: dict[str, Any]

    @property
    def blocks_share(self) -> float: ...

    @property
    def warnings(self) -> list[str]: ...

    @property
    def memory_note(self) -> str: ...

    def summary(self) -> str: ...


FORWARD, BACKWARD, HOOK = "#4C72B0", "#DD8452", "#55A868"


def _figure_class():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None, None
    return Figure, FigureCanvasAgg


class _Bars:
    """What the picture shows, whichever way it is drawn: one bar per block (forward and backward
    stacked) and per hooked point, in ms per profiled step, with its share of the step."""

    def __init__(self, report: Shown):
        self.on_device = on_device = report.profiled_step_device_s is not None

        def ms(row) -> float:
            return (row.device_s if on_device else row.total_s) * 1e3

        forward = {r.name: r for r in report.rows if r.kind == "block"}
        backward = {r.name: r for r in report.rows if r.kind == "block backward"}
        hooks = [r for r in report.rows if r.kind.startswith("hook")]
        self.has_backward, self.has_hooks = bool(backward), bool(hooks)
        self.labels = list(forward) + [
            f"hook {r.name}" + (" (backward)" if r.kind == "hook backward" else "") for r in hooks
        ]
        self.fwd = [ms(forward[n]) for n in forward] + [0.0] * len(hooks)
        self.bwd = [ms(backward[n]) if n in backward else 0.0 for n in forward] + [0.0] * len(hooks)
        self.hook = [0.0] * len(forward) + [ms(r) for r in hooks]
        self.shares = [forward[n].share + (backward[n].share if n in backward else 0.0) for n in forward]
        self.shares += [r.share for r in hooks]
        self.ends = [f + b + h for f, b, h in zip(self.fwd, self.bwd, self.hook, strict=True)]
        what = "forward + backward" if report.backward else "forward"
        self.title = f"Time per block: {report.model} on {report.device}, {what}"
        step = report.profiled_step_device_s if on_device else report.profiled_step_s
        self.subtitle = (
            f"profiled step {step * 1e3:.2f} ms, blocks {report.blocks_share:.1%} of it; "
            f"fastest step without the profiler {report.step_time_s * 1e3:.2f} ms"
        )
        self.xlabel = f"ms per step ({'device' if on_device else 'CPU'} time, under the profiler)"


def plot_svg(report: Shown) -> str:
    """The picture as SVG text: drawn here, with no plotting package, so the base install has it."""
    bars = _Bars(report)
    left, bar_w, right, row_h, top = 230, 480, 150, 22, 64
    width = left + bar_w + right
    height = top + row_h * max(len(bars.labels), 1) + 60
    scale = bar_w / (max(bars.ends, default=0.0) or 1.0)
    esc = html.escape
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="8" y="20" font-size="15">{esc(bars.title)}</text>',
        f'<text x="8" y="40" font-size="11" fill="#555555">{esc(bars.subtitle)}</text>',
    ]
    for i, label in enumerate(bars.labels):
        y = top + i * row_h
        out.append(f'<text x="{left - 8}" y="{y + 15}" text-anchor="end">{esc(label)}</text>')
        x = float(left)
        for value, color, name in (
            (bars.fwd[i], FORWARD, "forward"),
            (bars.bwd[i], BACKWARD, "backward"),
            (bars.hook[i], HOOK, "hooks"),
        ):
            if value > 0:
                w = value * scale
                out.append(
                    f'<rect x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{row_h - 6}" '
                    f'fill="{color}"><title>{esc(label)} {name}: {value:.3f} ms</title></rect>'
                )
                x += w
        out.append(f'<text x="{x + 6:.1f}" y="{y + 15}">{bars.ends[i]:.2f} ms  {bars.shares[i]:.1%}</text>')
    axis_y = top + row_h * len(bars.labels) + 6
    out.append(f'<line x1="{left}" y1="{axis_y}" x2="{left + bar_w}" y2="{axis_y}" stroke="#888888"/>')
    out.append(f'<text x="{left}" y="{axis_y + 18}" font-size="11">0</text>')
    out.append(
        f'<text x="{left + bar_w}" y="{axis_y + 18}" font-size="11" text-anchor="end">'
        f"{max(bars.ends, default=0.0):.2f}</text>"
    )
    out.append(
        f'<text x="{left + bar_w / 2}" y="{axis_y + 36}" font-size="11" text-anchor="middle">'
        f"{esc(bars.xlabel)}</text>"
    )
    legend = [("forward", FORWARD)] + [("backward", BACKWARD)] * bars.has_backward
    legend += [("hooks at the point (inside its block's bar)", HOOK)] * bars.has_hooks
    for j, (name, color) in enumerate(legend if len(legend) > 1 else []):
        x = 8 + j * 150
        out.append(
            f'<rect x="{x}" y="48" width="10" height="10" fill="{color}"/>'
            f'<text x="{x + 14}" y="57" font-size="11">{esc(name)}</text>'
        )
    out.append("</svg>")
    return "\n".join(out)


def plot_png(report: Shown) -> bytes | None:
    """The same picture as a PNG, through matplotlib; None when matplotlib is not installed (the
    SVG from `plot_svg` needs nothing)."""
    Figure, Canvas = _figure_class()
    if Figure is None:
        return None
    bars = _Bars(report)
    fig = Figure(figsize=(8.5, 1.6 + 0.34 * max(len(bars.labels), 1)), dpi=110, layout="constrained")
    Canvas(fig)
    ax = fig.add_subplot()
    y = list(range(len(bars.labels)))
    ax.barh(y, bars.fwd, color=FORWARD, label="forward")
    if bars.has_backward:
        ax.barh(y, bars.bwd, left=bars.fwd, color=BACKWARD, label="backward")
    if bars.has_hooks:
        ax.barh(y, bars.hook, color=HOOK, label="hooks at the point (inside its block's bar)")
    for yi, end, share in zip(y, bars.ends, bars.shares, strict=True):
        ax.text(end, yi, f"  {end:.2f} ms  {share:.1%}", va="center", fontsize=8)
    ax.set_yticks(y, bars.labels, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, max(bars.ends, default=1.0) * 1.28 or 1.0)
    ax.set_xlabel(bars.xlabel)
    ax.spines[["top", "right"]].set_visible(False)
    fig.suptitle(bars.title, fontsize=11, x=0.01, ha="left")
    ax.set_title(bars.subtitle, fontsize=8, color="#555555", loc="left")
    if bars.has_backward or bars.has_hooks:
        ax.legend(fontsize=8, loc="best", frameon=False)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _html_table(header: list[str], body: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>" for cells in body)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


def html_page(report: Shown, svg: str) -> str:
    """One file, no external resources: the picture inline (SVG) and the tables."""
    on_device = report.profiled_step_device_s is not None
    summary_lines = report.summary().split("\n\n")[0].split("\n")
    notes = [*report.warnings, report.memory_note]
    if report.hook_overhead is not None:
        notes.insert(
            0,
            f"hooks cost {report.hook_overhead:+.1%} per step "
            f"({report.step_time_s * 1e3:.2f} ms with, "
            f"{report.step_time_without_hooks_s * 1e3:.2f} ms without)",
        )
    if report.compile_stats:
        notes.append("compile: " + ", ".join(f"{k}={v}" for k, v in report.compile_stats.items()))
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>hookscope profile: {html.escape(report.model)}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ padding: 2px 10px; border-bottom: 1px solid #ddd; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; font-family: monospace; }}
svg {{ max-width: 100%; height: auto; }}
</style></head><body>
<h1>hookscope profile: {html.escape(report.model)}</h1>
{"".join(f"<p>{html.escape(line)}</p>" for line in summary_lines[1:])}
<figure>{svg}</figure>
<h2>Per block and hooked point (per step)</h2>
{_html_table(row_header(on_device), [row_cells(r, on_device) for r in report.rows])}
{"".join(f"<p>{html.escape(n)}</p>" for n in notes)}
<h2>Top operators (per step)</h2>
{_html_table(op_header(on_device), [op_cells(o, on_device) for o in report.top_ops])}
</body></html>
"""
