"""Which requests a vLLM forward holds (batch.PassReader), read from a model runner written here by
hand: a decode step of the same requests at the same rows is told so and read without a walk of its
requests, their positions moved on; anything else about the batch changed, it is walked again.
No engine: the runner's fields are the ones the reader reads (vLLM 0.32's `GPUModelRunner`).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from hookscope.engines.vllm.batch import TAG, PassReader


def state(tag: dict | None = None) -> SimpleNamespace:
    """A runner's state of one request, tagged for hookscope or not."""
    extra = {TAG: tag} if tag is not None else None
    return SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra), prompt_token_ids=[1, 2, 3])


def runner(held: dict, ids: list[str], starts: list[int], computed: list[int]) -> SimpleNamespace:
    """A model runner about to run a forward of `ids` at rows `starts` (one more than `ids`), each
    request's positions counting on from `computed`."""
    pad = 4  # vLLM's buffers are longer than the batch: only the first num_reqs entries count
    return SimpleNamespace(
        requests=held,
        input_batch=SimpleNamespace(
            num_reqs=len(ids),
            req_ids=[*ids, *["stale"] * pad],
            num_computed_tokens_cpu=np.array([*computed, *[99] * pad]),
        ),
        query_start_loc=SimpleNamespace(cpu=torch.tensor([*starts, *[starts[-1]] * pad], dtype=torch.int32)),
    )


def rows(found) -> list[tuple]:
    return [(r.req_id, r.tag.get("index"), r.start, r.end, r.offset) for r in found]


def test_a_decode_step_of_the_same_requests_is_told_and_its_positions_move_on():
    held = {"a": state({"run": "r", "index": 0}), "b": state(), "c": state({"run": "r", "index": 1})}
    reader = PassReader()
    found, same = reader.read(runner(held, ["a", "b", "c"], [0, 3, 5, 9], [0, 0, 0]))
    assert rows(found) == [("a", 0, 0, 3, 0), ("c", 1, 5, 9, 0)] and not same
    found, same = reader.read(runner(held, ["a", "b", "c"], [0, 1, 2, 3], [3, 2, 4]))
    assert rows(found) == [("a", 0, 0, 1, 3), ("c", 1, 2, 3, 4)] and not same  # rows moved: walked
    for step in range(1, 4):
        found, same = reader.read(runner(held, ["a", "b", "c"], [0, 1, 2, 3], [3 + step, 2 + step, 4 + step]))
        assert same and rows(found) == [("a", 0, 0, 1, 3 + step), ("c", 1, 2, 3, 4 + step)]
        assert found[0].state is held["a"] and found[1].state is held["c"]


def test_a_new_request_under_an_old_id_is_read_anew():
    held = {"a": state({"run": "r", "index": 0}), "b": state({"run": "r", "index": 1})}
    reader = PassReader()
    reader.read(runner(held, ["a", "b"], [0, 1, 2], [5, 5]))
    reader.read(runner(held, ["a", "b"], [0, 1, 2], [6, 6]))
    held["b"] = state({"run": "s", "index": 7})  # (ids, rows and positions as a decode step's)
    found, same = reader.read(runner(held, ["a", "b"], [0, 1, 2], [7, 0]))
    assert rows(found) == [("a", 0, 0, 1, 7), ("b", 7, 1, 2, 0)] and not same
    assert found[1].tag["run"] == "s"


def test_other_requests_coming_and_going_leave_the_tagged_rows_the_same():
    held = {"a": state({"run": "r", "index": 0}), "x": state(), "y": state()}
    reader = PassReader()
    reader.read(runner(held, ["a", "x"], [0, 1, 5], [4, 0]))
    found, same = reader.read(runner(held, ["a", "y"], [0, 1, 2], [5, 0]))  # x ended, y came
    assert same and rows(found) == [("a", 0, 0, 1, 5)]
    found, same = reader.read(runner(held, ["y", "a"], [0, 1, 2], [1, 6]))  # a moved to row 1
    assert not same and rows(found) == [("a", 0, 1, 2, 6)]


def test_every_request_is_read_while_some_edit_applies_to_all():
    held = {"a": state({"run": "r", "index": 0}), "x": state()}
    reader = PassReader()
    found, _ = reader.read(runner(held, ["a", "x"], [0, 1, 2], [4, 4]))
    assert [r.req_id for r in found] == ["a"]
    found, same = reader.read(runner(held, ["a", "x"], [0, 1, 2], [5, 5]), every=True)
    assert [r.req_id for r in found] == ["a", "x"] and found[1].tag == {} and not same
