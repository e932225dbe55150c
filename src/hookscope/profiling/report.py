"""What a profile found, as data (`ProfileReport`), as text (`summary()`) and as files (`write()`)."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import HookscopeError
from .events import OpRow, Row
from .trace import write_trace

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
            (f"hookscope profile: {self.model} on {self.device}, {what}, "
             f"{self.steps} profiled steps after {self.warmup} warm-up"),
            (f"step: {_ms(self.step_time_s)} (fastest of {self.steps}, wall clock, no profiler); "
             f"{_ms(self.profiled_step_s)} under the profiler{device_step}"),
        ]
        if self.block_rows():
            lines.append(f"blocks: {self.blocks_share:.1%} of the profiled step "
                         "(hook rows are part of their block's time)")
        else:
            lines.append("no repeated blocks found in this model: rows cover hooked points only")
        lines += ["", _table(self.rows, on_device)]
        if self.hook_overhead is not None:
            lines += ["", (f"hooks cost {self.hook_overhead:+.1%} per step: "
                           f"{_ms(self.step_time_s)} with them, "
                           f"{_ms(self.step_time_without_hooks_s)} without "
                           f"(fastest of {self.steps} steps each)")]
        if self.compile_stats:
            lines += ["", "compile: " + ", ".join(f"{k}={v}" for k, v in self.compile_stats.items())]
        clock = "device" if on_device else "CPU"
        lines += ["", self.memory_note, "", f"top operators by self {clock} time, per step:",
                  _ops_table(self.top_ops, on_device)]
        return "\n".join(lines)

    def write(self, out_dir: str | Path) -> dict[str, Path]:
        """Write table.txt, trace.json (Chrome / Perfetto), time_per_block.png, report.html and,
        on CUDA, memory_snapshot.pickle; returns {kind: path}."""
        from .render import html_page, plot_png

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if self.profiler is None:
            raise HookscopeError("this report has no profiler run attached; make it with hs.profile(...)")
        files = {"table": out / "table.txt", "trace": out / "trace.json"}
        files["table"].write_text(self.summary() + "\n")
        write_trace(self.profiler, files["trace"])
        if self.memory_snapshot is not None:
            # PyTorch's memory viewer reads this pickle; we only ever write it, never load it
            files["memory"] = out / "memory_snapshot.pickle"
            files["memory"].write_bytes(pickle.dumps(self.memory_snapshot))
        png = plot_png(self, written=list(files.values()))
        files["plot"] = out / "time_per_block.png"
        files["plot"].write_bytes(png)
        files["html"] = out / "report.html"
        files["html"].write_text(html_page(self, png), encoding="utf-8")
        return files


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:+.2f} MiB"


def row_cells(row: Row, on_device: bool) -> list[str]:
    cells = [row.name, row.kind, f"{row.calls:g}", f"{row.self_s * 1e3:.3f}", f"{row.total_s * 1e3:.3f}"]
    if on_device:
        cells += [f"{row.device_s * 1e3:.3f}", mib(row.device_mem_bytes)]
    return cells + [f"{row.share:.1%}", mib(row.cpu_mem_bytes)]


def row_header(on_device: bool) -> list[str]:
    head = ["point", "kind", "calls", "self ms", "total ms"]
    if on_device:
        head += ["device ms", "device mem"]
    return head + ["share", "CPU mem"]


def op_cells(op: OpRow, on_device: bool) -> list[str]:
    cells = [op.name, f"{op.calls:g}", f"{op.self_s * 1e3:.3f}", f"{op.total_s * 1e3:.3f}"]
    if on_device:
        cells.append(f"{op.self_device_s * 1e3:.3f}")
    return cells + [mib(op.self_cpu_mem_bytes)]


def op_header(on_device: bool) -> list[str]:
    device = ["self device ms"] if on_device else []
    return ["operator", "calls", "self ms", "total ms", *device, "self CPU mem"]


def _aligned(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def fmt(cells: list[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs)

    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, body)])


def _table(rows: list[Row], on_device: bool) -> str:
    return _aligned(row_header(on_device), [row_cells(r, on_device) for r in rows])


def _ops_table(ops: list[OpRow], on_device: bool) -> str:
    return _aligned(op_header(on_device), [op_cells(o, on_device) for o in ops])
