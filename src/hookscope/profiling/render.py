"""The picture (PNG bar chart of time per block) and the self-contained HTML page.

matplotlib is optional (`pip install 'hookscope[plot]'`) and is driven through its object API
with the Agg canvas, so the user's pyplot backend is never switched.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import HookscopeError
from .report import op_cells, op_header, row_cells, row_header

if TYPE_CHECKING:
    from .report import ProfileReport

FORWARD, BACKWARD, HOOK = "#4C72B0", "#DD8452", "#55A868"


def _figure_class():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None, None
    return Figure, FigureCanvasAgg


def plot_png(report: ProfileReport, written: list[Path] = ()) -> bytes:
    """A horizontal bar per block (forward and backward stacked) and per hooked point: time per
    profiled step, labelled with its share of the step."""
    Figure, Canvas = _figure_class()
    if Figure is None:
        done = ", ".join(str(p) for p in written) or "nothing"
        raise HookscopeError(
            "the time-per-block picture needs matplotlib: pip install 'hookscope[plot]' "
            f"(already written: {done})"
        )
    on_device = report.profiled_step_device_s is not None

    def ms(row) -> float:
        return (row.device_s if on_device else row.total_s) * 1e3

    forward = {r.name: r for r in report.rows if r.kind == "block"}
    backward = {r.name: r for r in report.rows if r.kind == "block backward"}
    hooks = [r for r in report.rows if r.kind.startswith("hook")]
    labels = list(forward) + [f"hook {r.name}" + (" (backward)" if r.kind == "hook backward" else "")
                              for r in hooks]
    fwd = [ms(forward[n]) for n in forward] + [0.0] * len(hooks)
    bwd = [ms(backward[n]) if n in backward else 0.0 for n in forward] + [0.0] * len(hooks)
    hook_ms = [0.0] * len(forward) + [ms(r) for r in hooks]
    shares = [forward[n].share + (backward[n].share if n in backward else 0.0) for n in forward]
    shares += [r.share for r in hooks]

    fig = Figure(figsize=(8.5, 1.6 + 0.34 * max(len(labels), 1)), dpi=110, layout="constrained")
    Canvas(fig)
    ax = fig.add_subplot()
    y = list(range(len(labels)))
    ax.barh(y, fwd, color=FORWARD, label="forward")
    if backward:
        ax.barh(y, bwd, left=fwd, color=BACKWARD, label="backward")
    if hooks:
        ax.barh(y, hook_ms, color=HOOK, label="hooks at the point (inside its block's bar)")
    ends = [f + b + h for f, b, h in zip(fwd, bwd, hook_ms, strict=True)]
    for yi, end, share in zip(y, ends, shares, strict=True):
        ax.text(end, yi, f"  {end:.2f} ms  {share:.1%}", va="center", fontsize=8)
    ax.set_yticks(y, labels, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, max(ends, default=1.0) * 1.28 or 1.0)
    clock = "device" if on_device else "CPU"
    ax.set_xlabel(f"ms per step ({clock} time, under the profiler)")
    ax.spines[["top", "right"]].set_visible(False)
    what = "forward + backward" if report.backward else "forward"
    fig.suptitle(f"Time per block: {report.model} on {report.device}, {what}", fontsize=11, x=0.01, ha="left")
    step = report.profiled_step_device_s if on_device else report.profiled_step_s
    ax.set_title(f"profiled step {step * 1e3:.2f} ms, blocks {report.blocks_share:.1%} of it; "
                 f"fastest step without the profiler {report.step_time_s * 1e3:.2f} ms",
                 fontsize=8, color="#555555", loc="left")
    if backward or hooks:
        ax.legend(fontsize=8, loc="best", frameon=False)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _html_table(header: list[str], body: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>" for cells in body)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


def html_page(report: ProfileReport, png: bytes) -> str:
    """One file, no external resources: the picture inline (base64) and the tables."""
    on_device = report.profiled_step_device_s is not None
    summary_lines = report.summary().split("\n\n")[0].split("\n")
    notes = [report.memory_note]
    if report.hook_overhead is not None:
        notes.insert(0, f"hooks cost {report.hook_overhead:+.1%} per step "
                        f"({report.step_time_s * 1e3:.2f} ms with, "
                        f"{report.step_time_without_hooks_s * 1e3:.2f} ms without)")
    if report.compile_stats:
        notes.append("compile: " + ", ".join(f"{k}={v}" for k, v in report.compile_stats.items()))
    image = base64.b64encode(png).decode("ascii")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>hookscope profile: {html.escape(report.model)}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ padding: 2px 10px; border-bottom: 1px solid #ddd; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; font-family: monospace; }}
img {{ max-width: 100%; }}
</style></head><body>
<h1>hookscope profile: {html.escape(report.model)}</h1>
{"".join(f"<p>{html.escape(line)}</p>" for line in summary_lines[1:])}
<img alt="time per block" src="data:image/png;base64,{image}">
<h2>Per block and hooked point (per step)</h2>
{_html_table(row_header(on_device), [row_cells(r, on_device) for r in report.rows])}
{"".join(f"<p>{html.escape(n)}</p>" for n in notes)}
<h2>Top operators (per step)</h2>
{_html_table(op_header(on_device), [op_cells(o, on_device) for o in report.top_ops])}
</body></html>
"""
