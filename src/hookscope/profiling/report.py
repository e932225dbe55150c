"""What a profile found, as data (`ProfileReport`), as text (`summary()`) and as files (`write()`)."""

from __future__ import annotations

import pickle
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import HookscopeError
from .events import OpRow, Row, relative_spread
from .render import html_page, plot_png, plot_svg
from .table import op_cells, op_header, row_cells, row_header, text_table
from .trace import write_trace

WIDE_SPREAD = 0.25  # slowest - fastest step over the median: beyond it, the summary warns
MIN_OVERHEAD_NOISE = 0.02  # a hook overhead is "within the noise" when pairs spread wider than this

CPU_MEMORY_NOTE = (
    "memory: CPU run, so no allocator timeline (that is CUDA only); the table's 'CPU mem' column is "
    "the net CPU memory each block allocated (allocations minus frees, from profile_memory)"
)
CUDA_MEMORY_NOTE = (
    "memory: CUDA allocator history of the profiled steps in memory_snapshot.pickle "
    "(open it at https://pytorch.org/memory_viz); the table also has net memory per block"
)


@dataclass
class ProfileReport:
    """Where the time and memory of one training / inference step go, per block and hooked point.

    `rows`: one per block (kind "block"), per block backward ("block backward", when profiled
    with backward=True), and per hooked point ("hook" / "hook backward"); times per step.
    `step_time_s`: the fastest wall-clock step without the profiler, with the user's hooks on.
    `profiled_step_s`: the step under the profiler (the range all rows are shares of).
    `hook_overhead`: (step with the user's hooks) / (step without) - 1, or None without hooks.
    `compile_stats`: compiler counters, filled by whoever compiled the model.
    `not_loaded`: on a model loaded with `points=`, what the steps did not run (its weights were
    not loaded); None when the whole model ran.
    """

    model: str
    device: str
    backward: bool
    steps: int
    warmup: int
    rows: list[Row]
    top_ops: list[OpRow]
    step_time_s: float
    profiled_step_s: float
    profiled_step_device_s: float | None = None
    hook_overhead: float | None = None
    step_time_without_hooks_s: float | None = None
    compile_stats: dict[str, Any] = field(default_factory=dict)
    memory_snapshot: dict | None = field(default=None, repr=False)  # CUDA allocator history
    profiler: Any = field(default=None, repr=False)  # the finished torch.profiler run, for the trace
    step_times_s: list[float] = field(default_factory=list)  # every timed step, with the hooks
    step_times_without_hooks_s: list[float] | None = None  # paired with step_times_s, one each
    not_loaded: str | None = None
    _trace_text: str | None = field(default=None, repr=False, compare=False)

    @property
    def step_spread(self) -> float | None:
        """(slowest - fastest) / median of the timed steps; None with a single step."""
        return relative_spread(self.step_times_s)

    @property
    def hook_overhead_range(self) -> tuple[float, float] | None:
        """The smallest and largest hook overhead of one pair of steps (with, then without)."""
        without = self.step_times_without_hooks_s
        if not without or len(without) < 2:
            return None
        ratios = [a / b - 1.0 for a, b in zip(self.step_times_s, without, strict=True)]
        return min(ratios), max(ratios)

    @property
    def warnings(self) -> list[str]:
        """What makes the figures unreliable: steps whose times spread widely (a busy machine, a
        step too short to time), a hook overhead smaller than its own noise."""
        out = []
        spread = self.step_spread
        if spread is not None and spread > WIDE_SPREAD:
            out.append(
                f"warning: the {len(self.step_times_s)} timed steps took {_ms(min(self.step_times_s))} to "
                f"{_ms(max(self.step_times_s))} (spread {spread:.0%} of the median): the machine is busy "
                "or a step is too short to time; read the times as rough, see each row's spread, and "
                "re-run with more --steps on a quieter machine"
            )
        wide = [
            r.name
            for r in self.rows
            if r.spread is not None
            and r.spread > WIDE_SPREAD
            and r.kind in ("block", "block backward")
            and r.share >= 0.05
        ]
        if wide and not out:
            out.append(
                f"warning: {', '.join(wide)} varied by more than {WIDE_SPREAD:.0%} between "
                "profiled steps (see the spread column); re-run with more --steps"
            )
        span = self.hook_overhead_range
        if (
            span is not None
            and self.hook_overhead is not None
            and span[1] - span[0] > max(abs(self.hook_overhead), MIN_OVERHEAD_NOISE)
        ):
            out.append(
                f"warning: the hook overhead of one pair of steps ranged from {span[0]:+.1%} to "
                f"{span[1]:+.1%}: {self.hook_overhead:+.1%} is within the machine's noise"
            )
        return out

    def block_rows(self) -> list[Row]:
        return [r for r in self.rows if r.kind in ("block", "block backward")]

    @property
    def blocks_share(self) -> float:
        """The fraction of the profiled step spent inside blocks (forward and backward)."""
        return sum(r.share for r in self.block_rows())

    @property
    def memory_note(self) -> str:
        return CUDA_MEMORY_NOTE if self.memory_snapshot is not None else CPU_MEMORY_NOTE

    def summary(self) -> str:
        on_device = self.profiled_step_device_s is not None
        what = "forward + backward" if self.backward else "forward"
        device_step = f", {_ms(self.profiled_step_device_s)} on the device" if on_device else ""
        lines = [
            (
                f"hookscope profile: {self.model} on {self.device}, {what}, "
                f"{self.steps} profiled steps after {self.warmup} warm-up"
            ),
            (
                f"step: {_ms(self.step_time_s)} (fastest of {self.steps}, wall clock, no profiler"
                f"{_spread_note(self.step_times_s)}); {_ms(self.profiled_step_s)} under the "
                f"profiler{device_step}"
            ),
        ]
        if self.not_loaded is not None:
            lines.append(f"not profiled: {self.not_loaded}")
        if self.block_rows():
            lines.append(
                f"blocks: {self.blocks_share:.1%} of the profiled step "
                "(hook rows are part of their block's time)"
            )
        elif self.not_loaded is None:
            lines.append("no repeated blocks found in this model: rows cover hooked points only")
        lines += ["", text_table(row_header(on_device), [row_cells(r, on_device) for r in self.rows])]
        if self.hook_overhead is not None:
            lines += [
                "",
                (
                    f"hooks cost {self.hook_overhead:+.1%} per step: "
                    f"{_ms(self.step_time_s)} with them, "
                    f"{_ms(self.step_time_without_hooks_s)} without "
                    f"(fastest of {self.steps} steps each"
                    + (
                        ", one pair of steps: {:+.1%} to {:+.1%}".format(*self.hook_overhead_range)
                        if self.hook_overhead_range
                        else ""
                    )
                    + ")"
                ),
            ]
        if self.compile_stats:
            lines += ["", "compile: " + ", ".join(f"{k}={v}" for k, v in self.compile_stats.items())]
        if self.warnings:
            lines += ["", *self.warnings]
        clock = "device" if on_device else "CPU"
        lines += [
            "",
            self.memory_note,
            "",
            f"top operators by self {clock} time, per step:",
            text_table(op_header(on_device), [op_cells(o, on_device) for o in self.top_ops]),
        ]
        return "\n".join(lines)

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """Write table.txt, trace.json (Chrome / Perfetto), time_per_block.svg (the picture; no
        extra package needed), time_per_block.png (only when matplotlib is installed), report.html
        (the picture inline) and, on CUDA, memory_snapshot.pickle; returns {kind: path}.
        An --out that cannot be written raises HookscopeError, naming it."""
        if self.profiler is None:
            raise HookscopeError("this report has no profiler run attached; make it with hs.profile(...)")
        out = writable_dir(out_dir)
        files = {"table": out / "table.txt", "trace": out / "trace.json"}
        try:
            files["table"].write_text(self.summary() + "\n")
            if self._trace_text is None:  # the profiler exports its trace once only: keep it
                write_trace(self.profiler, files["trace"])
                self._trace_text = files["trace"].read_text()
            else:
                files["trace"].write_text(self._trace_text)
            if self.memory_snapshot is not None:
                # PyTorch's memory viewer reads this pickle; we only ever write it, never load it
                files["memory"] = out / "memory_snapshot.pickle"
                files["memory"].write_bytes(pickle.dumps(self.memory_snapshot))
            svg = plot_svg(self)
            files["picture"] = out / "time_per_block.svg"
            files["picture"].write_text(svg, encoding="utf-8")
            png = plot_png(self)
            if png is not None:
                files["plot"] = out / "time_per_block.png"
                files["plot"].write_bytes(png)
            files["html"] = out / "report.html"
            files["html"].write_text(html_page(self, svg), encoding="utf-8")
        except OSError as e:
            raise HookscopeError(
                f"cannot write the profile into {out}: {e.strerror or e}; choose "
                "another --out / out_dir (the printed summary is complete)"
            ) from e
        return files


def writable_dir(out_dir: str | Path) -> Path:
    """`out_dir`, created if needed, once a file could be made in it; else a HookscopeError. Asked
    before a profile runs, so a typo in --out costs nothing."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise HookscopeError(
            f"cannot write the profile into {out}: {e.strerror or e}; choose a "
            "writable directory for --out / out_dir"
        ) from e
    return out


def _spread_note(times: list[float]) -> str:
    spread = relative_spread(times)
    return "" if spread is None else f"; slowest {_ms(max(times))}, spread {spread:.0%}"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"
