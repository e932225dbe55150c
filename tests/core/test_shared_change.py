"""`SharedChange`: one process-wide setting, changed by the first of several nested or concurrent
blocks and put back by the last. The setting here is a plain dict the test reads, and every call
of the change and the restore is logged."""

from __future__ import annotations

import pytest

from hookscope.shared_change import SharedChange


def a_setting(decline: list[bool]):
    setting = {"value": "user's"}
    calls: list[str] = []

    def change():
        calls.append("change")
        if decline and decline.pop(0):
            return None
        found, setting["value"] = setting["value"], "ours"
        return found

    def restore(found):
        calls.append(f"restore {found}")
        setting["value"] = found

    return setting, calls, SharedChange(change, restore)


def test_the_first_block_changes_the_last_puts_back_and_an_error_still_puts_back():
    setting, calls, shared = a_setting([])
    with pytest.raises(RuntimeError), shared.held() as outer:
        assert outer and setting["value"] == "ours"
        with shared.held() as inner:
            assert inner
        assert setting["value"] == "ours"  # the outer block still holds it
        raise RuntimeError("the work failed")
    assert setting["value"] == "user's"
    assert calls == ["change", "restore user's"]  # once each, for both blocks


def test_a_declined_change_holds_nothing_and_the_next_block_asks_again():
    setting, calls, shared = a_setting([True])
    with shared.held() as first:
        assert not first and setting["value"] == "user's"
    assert calls == ["change"]  # nothing to put back
    with shared.held() as second:
        assert second and setting["value"] == "ours"
    assert setting["value"] == "user's"
    assert calls == ["change", "change", "restore user's"]
