"""Python's cyclic garbage collector, held back while hookscope builds many objects that live on.

The collector runs on counts of allocations, not on garbage, and each full collection walks every
object the process holds (~200,000 once torch and transformers are imported). Work that builds
objects by the hundred thousand and frees few of them sets off collection after collection for
nothing:

- `paused()`: no collection at all, for work that makes no cycles (syntax trees, a manifest's
  entries);
- `young_only()`: young collections go on (a cycle that dies young is freed as before), full ones
  wait until the work ends, for importing a model's code and building it (`hs.load`), where full
  collections took a large share of a model's first load (bench/HISTORY.md, Loading a model, "Full
  collections during a load"). Python 3.14 scans the old objects in
  increments and has no third threshold to hold back: there it does nothing.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterator

from .shared_change import SharedChange

_HELD_BACK = 2**31 - 1  # the full-collection threshold while held back: never reached


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No cyclic collection inside (none is missed: the next one after finds what was made)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def young_only() -> contextlib.AbstractContextManager[bool]:
    """Full collections held back inside; the young and middle generations collected as always.
    Nested and concurrent blocks share one hold: the last to end puts the threshold back."""
    return _FULL_COLLECTIONS_HELD.held()


def _hold_back() -> int | None:
    """The third threshold as found (None on Python 3.14: nothing to hold back), then held back."""
    if sys.version_info >= (3, 14):
        return None
    young, middle, full = gc.get_threshold()
    gc.set_threshold(young, middle, _HELD_BACK)
    return full


def _let_go(full: int) -> None:
    young, middle, _ = gc.get_threshold()  # a change the user made meanwhile stays
    gc.set_threshold(young, middle, full)


_FULL_COLLECTIONS_HELD = SharedChange(_hold_back, _let_go)
