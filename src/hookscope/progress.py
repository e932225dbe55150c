"""The one progress bar: a tqdm bar in rows (the unit every summary counts), made at its first
update so that an error found before any work prints no empty bar, with an optional total that
may be re-estimated as the work goes, and a short note (MiB written) after the count."""

from __future__ import annotations

from typing import Any


class RowsBar:
    """`update(rows, total=, note=)` per step, `close(note=)` at the end; does nothing when disabled."""

    def __init__(self, desc: str, *, enabled: bool = True, total: int | None = None, unit: str = "row"):
        self.desc, self.enabled, self.total, self.unit = desc, enabled, total, unit
        self.bar: Any = None
        self.count = 0
        self.where, self.note = "", ""  # where a long step is (a streamed run's block), the note

    def stage(self, where: str) -> None:
        """Show where the work is now (before the note), without counting rows."""
        if self.enabled:
            self.where = where + ", "
            self._open()
            self.bar.set_postfix_str(self.where + self.note)

    def _open(self) -> None:
        if self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=self.total, unit=self.unit, unit_scale=True, desc=self.desc, dynamic_ncols=True
            )

    def update(self, rows: int, *, total: int | None = None, note: str | None = None) -> None:
        if not self.enabled:
            return
        self._open()
        self.count += rows
        if total is not None:  # an estimate never falls behind what was done
            self.bar.total = max(total, self.count)
        if note is not None:
            self.note = note
            self.bar.set_postfix_str(self.where + note, refresh=False)
        self.bar.update(rows)

    def close(self, *, note: str | None = None, complete: bool = False) -> None:
        """`complete`: the estimate is done with, the bar ends at 100%."""
        if self.bar is None:
            return
        if complete:
            self.bar.total = self.bar.n
        if note is not None:
            self.bar.set_postfix_str(note, refresh=False)
        self.bar.refresh()
        self.bar.close()


def mib_written(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB written"
