"""The cells of a profile's tables, shared by the text summary (report.py) and the HTML page
(render.py): one place says what each column shows."""

from __future__ import annotations

from .events import OpRow, Row


def mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:+.2f} MiB"


def row_cells(row: Row, on_device: bool) -> list[str]:
    cells = [row.name, row.kind, f"{row.calls:g}", f"{row.self_s * 1e3:.3f}", f"{row.total_s * 1e3:.3f}"]
    if on_device:
        cells += [f"{row.device_s * 1e3:.3f}", mib(row.device_mem_bytes)]
    spread = "-" if row.spread is None else f"{row.spread:.0%}"
    return cells + [spread, f"{row.share:.1%}", mib(row.cpu_mem_bytes)]


def row_header(on_device: bool) -> list[str]:
    head = ["point", "kind", "calls", "self ms", "total ms"]
    if on_device:
        head += ["device ms", "device mem"]
    return head + ["spread", "share", "CPU mem"]


def op_cells(op: OpRow, on_device: bool) -> list[str]:
    cells = [op.name, f"{op.calls:g}", f"{op.self_s * 1e3:.3f}", f"{op.total_s * 1e3:.3f}"]
    if on_device:
        cells.append(f"{op.self_device_s * 1e3:.3f}")
    return cells + [mib(op.self_cpu_mem_bytes)]


def op_header(on_device: bool) -> list[str]:
    device = ["self device ms"] if on_device else []
    return ["operator", "calls", "self ms", "total ms", *device, "self CPU mem"]


def text_table(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def fmt(cells: list[str]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs)

    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, body)])
