"""The cyclic garbage collector held back (collector.py): full collections wait while `hs.load`
builds a model, young ones go on, and the thresholds come back however the work ends. The
collections that ran are counted through `gc.callbacks`, Python's own report of them."""

from __future__ import annotations

import gc
import sys
import threading
import weakref

import pytest

import hookscope as hs
from hookscope import collector
from hookscope.errors import ModelLoadError
from hookscope.loading import loader

needs_third_threshold = pytest.mark.skipif(
    sys.version_info >= (3, 14), reason="Python 3.14 collects old objects in increments: no third threshold"
)


class Collections:
    """The generations of the collections Python ran inside the block."""

    def __enter__(self) -> list[int]:
        self.seen: list[int] = []
        gc.callbacks.append(self._record)
        return self.seen

    def _record(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.seen.append(info["generation"])

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._record)


def long_lived_objects(n: int) -> list:
    """n small containers that stay alive: what importing and building a model makes."""
    return [[i] for i in range(n)]


@needs_third_threshold
@pytest.mark.slow
def test_full_collections_wait_and_young_ones_go_on():
    gc.collect()
    with Collections() as outside:  # the control: the same work sets off full collections
        kept = long_lived_objects(len(gc.get_objects()))
    assert 2 in outside
    del kept
    gc.collect()
    with collector.young_only(), Collections() as inside:
        kept = long_lived_objects(len(gc.get_objects()))
    assert 2 not in inside
    assert inside.count(0) > 100 and 1 in inside  # the young and middle generations, as always
    del kept


def test_a_cycle_that_dies_young_is_still_freed():
    class Node:
        pass

    with collector.young_only():
        a, b = Node(), Node()
        a.other, b.other = b, a
        alive = weakref.ref(a)
        del a, b
        long_lived_objects(50_000)  # allocations enough for young and middle collections
        assert alive() is None  # no gc.collect() called: the collector's own young collection


@needs_third_threshold
def test_the_threshold_comes_back_after_an_error_nesting_and_overlapping_threads():
    before = gc.get_threshold()
    with pytest.raises(RuntimeError), collector.young_only():
        raise RuntimeError("the work failed")
    assert gc.get_threshold() == before
    with collector.young_only():
        with collector.young_only():
            pass
        assert gc.get_threshold()[2] > 10**9  # the outer block still holds
    assert gc.get_threshold() == before

    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    held_after_first: list[int] = []

    def first() -> None:
        with collector.young_only():
            first_in.set()
            second_in.wait()
        first_out.set()

    def second() -> None:
        first_in.wait()
        with collector.young_only():
            second_in.set()
            first_out.wait()
            held_after_first.append(gc.get_threshold()[2])

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert held_after_first[0] > 10**9  # the first to end did not let go of the second's hold
    assert gc.get_threshold() == before


@needs_third_threshold
def test_a_young_threshold_set_meanwhile_is_kept():
    before = gc.get_threshold()
    try:
        with collector.young_only():
            gc.set_threshold(before[0] + 1, before[1], gc.get_threshold()[2])
        assert gc.get_threshold() == (before[0] + 1, before[1], before[2])
    finally:
        gc.set_threshold(*before)


def test_paused_stops_collections_and_keeps_a_users_choice():
    assert gc.isenabled()
    with collector.paused(), Collections() as inside:
        assert not gc.isenabled()
        kept = long_lived_objects(20_000)
    assert inside == [] and gc.isenabled()
    gc.disable()
    try:
        with collector.paused():
            pass
        assert not gc.isenabled()  # the user's own pause outlives ours
    finally:
        gc.enable()
    del kept


@needs_third_threshold
def test_load_holds_back_full_collections_while_it_builds(monkeypatch, tiny_dirs):
    before = gc.get_threshold()
    during: list[int] = []
    real_arch_of = loader.arch_of

    def arch_of(model):  # called inside load, once the model is built
        during.append(gc.get_threshold()[2])
        return real_arch_of(model)

    monkeypatch.setattr(loader, "arch_of", arch_of)
    loaded = hs.load(str(tiny_dirs["gpt2"]))
    assert loaded.model is not None and during and during[0] > 10**9
    assert gc.get_threshold() == before
    with pytest.raises(ModelLoadError):
        hs.load(str(tiny_dirs["gpt2"] / "no-such-model"))
    assert gc.get_threshold() == before
