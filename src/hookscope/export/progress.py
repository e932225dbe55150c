"""The export commands' bar: the one progress bar (`hookscope.progress.RowsBar`) counting exported rows,
or nothing when progress is off."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..progress import RowsBar


@contextmanager
def rows_progress(total: int, desc: str, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    if not enabled:
        yield None
        return
    bar = RowsBar(desc, total=total)
    try:
        yield bar.update
    finally:
        bar.close()
