"""A tqdm bar counting exported rows (or nothing, when progress is off)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def rows_progress(total: int, desc: str, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    if not enabled:
        yield None
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=total, unit="row", unit_scale=True, desc=desc, dynamic_ncols=True)
    try:
        yield bar.update
    finally:
        bar.close()
