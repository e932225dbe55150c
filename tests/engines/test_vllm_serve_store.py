"""`vllm serve` writing the captures of the requests that ask into a hookscope store
(engines/vllm/capture_store.py), driven over HTTP by urllib on 127.0.0.1.

- Three requests sent at once, two asking for a capture (one by the id vLLM gives it, one under its
  own `hookscope.capture_id`), one not: after the server stops, the store holds the two prompts'
  rows, each equal to hookscope's Hugging Face capture of that prompt alone, found by the id the
  client has; the third has none. The store was started before the server by another run of the
  same settings: the server appends to it, and its rows are still there.
- A malformed capture request gets HTTP 400.
Plus the checks that need no server: a store of other points refused before any worker call, and a
capture asked of a server with no store.
"""

from __future__ import annotations

import threading
import types

import pytest
import torch
from gate import need

need("vllm")

from vllm_models import assert_close, hf_model, save  # noqa: E402
from vllm_server import post_json  # noqa: E402
from vllm_shared import EARLIER, key_of, start_store, vllm_config  # noqa: E402
from vllm_shared import STORE_POINTS as POINTS  # noqa: E402

import hookscope as hs  # noqa: E402
from hookscope.engines.vllm import serve  # noqa: E402

# request -> (prompt, vllm_xargs); prompts of different lengths, so that rows filed under the wrong
# request show
ASKED = {
    "by_id": ([5, 17, 33, 64, 9, 40, 70, 12, 101, 3], {"hookscope.capture": 1}),
    "mine": (
        [8, 2, 77, 31, 5, 19, 44, 90, 6, 13, 58, 21, 3, 99, 7, 11, 64],
        {"hookscope.capture": 1, "hookscope.capture_id": "mine"},
    ),
    "plain": ([4, 28, 61, 9, 15, 33, 2], {}),
}


@pytest.fixture(scope="module")
def served(llama_server, shared_vllm):
    """The three requests sent at once and a bad one, answered; then the server stopped. The server
    is test_vllm_serve.py's too (vllm_shared.start_llama_server): its requests ask for no capture,
    and the store's row count below would show one that wrote."""
    url, directory = llama_server.url, llama_server.directory
    answers: dict = {}
    try:
        begin = threading.Barrier(len(ASKED))

        def send(name: str) -> None:
            prompt, xargs = ASKED[name]
            body = {"model": str(directory), "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
            begin.wait()
            answers[name] = post_json(url, "/v1/completions", {**body, "vllm_xargs": xargs})

        threads = [threading.Thread(target=send, args=(name,)) for name in ASKED]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        bad = {"model": str(directory), "prompt": [5, 6], "max_tokens": 1}
        answers["bad"] = post_json(
            url, "/v1/completions", {**bad, "vllm_xargs": {"hookscope.capture_id": "x"}}
        )
    finally:
        shared_vllm.release("llama_server")  # every row the server wrote is committed when it stops
    return types.SimpleNamespace(answers=answers, out=llama_server.out, directory=directory)


@pytest.mark.slow  # one server start: 30-90 s
def test_the_store_holds_each_asking_request_s_prompt_rows_as_hugging_face_gives_them(served):
    for name in ASKED:
        status, body = served.answers[name]
        assert status == 200, (name, body)
    store = hs.open_store(served.out)
    store.verify()
    docs, positions = store.tensor("doc_ids"), store.tensor("positions")
    found = {
        "by_id": key_of(served.answers["by_id"][1]["id"] + "-0"),  # the completion's prompt 0
        "mine": key_of("mine"),
        "plain": key_of(served.answers["plain"][1]["id"] + "-0"),
    }
    assert len(set(found.values())) == 3
    earlier = docs == key_of(EARLIER[0])
    assert int(earlier.sum()) == EARLIER[1], "the rows the store held before the server started are gone"
    assert not (docs == found["plain"]).any(), "a request that did not ask has rows in the store"
    lengths = {name: len(ASKED[name][0]) for name in ("by_id", "mine")}
    want_rows = EARLIER[1] + sum(lengths.values())
    assert len(store) == want_rows, (
        f"{len(store)} rows, not the earlier {EARLIER[1]} and the prompts' {lengths}"
    )

    hf = hf_model(served.directory)
    for name, n in lengths.items():
        mine = docs == found[name]
        assert int(mine.sum()) == n, f"{name}: {int(mine.sum())} rows for a {n}-token prompt"
        assert positions[mine].tolist() == list(range(n)), f"{name}: not in position order"
        assert store.tensor("token_ids")[mine].tolist() == ASKED[name][0], name
        want = hs.collect(hf, torch.tensor([ASKED[name][0]]), POINTS)
        for point in POINTS:
            got = store.tensor(point)[mine]
            assert_close(got, want[point][0], f"{name} {point}")  # float32, 1e-5 of the largest value


@pytest.mark.slow
def test_a_malformed_capture_request_gets_400(served):
    status, body = served.answers["bad"]
    assert status == 400, body
    assert "hookscope.capture_id" in str(body) and '"hookscope.capture": 1' in str(body), body


# ---- the checks that need no server ----


def test_a_store_of_other_points_is_refused_before_any_worker_call(tmp_path):
    directory = save("llama", tmp_path / "llama", seed=4)
    start_store(directory, tmp_path / "acts")
    other = serve.StoreOptions(str(tmp_path / "acts"), ["blocks.0.resid_post"])
    with pytest.raises(hs.StoreError, match=r"different settings:\n  points: stored"):
        serve.store_call(vllm_config(directory), other)
    with pytest.raises(hs.EngineError, match="--no-enable-prefix-caching"):
        serve.store_call(vllm_config(directory, prefix_caching=True), other)
    with pytest.raises(hs.EngineError, match="--shutdown-timeout 30"):
        serve.store_call(vllm_config(directory, shutdown_timeout=0), other)


@pytest.mark.parametrize(
    "xargs, store, n, says",
    [
        ({"hookscope.capture": 1}, None, 1, "this server writes no hookscope store"),
        ({"hookscope.capture": 1}, "acts", 2, "one completion (n=1, got n=2)"),
        ({"hookscope.capture": 2}, "acts", 1, "is 1 (capture this request) or 0, got 2"),
        ({"hookscope.capture": 1, "hookscope.capture_id": ""}, "acts", 1, "a non-empty string"),
    ],
)
def test_a_capture_the_server_cannot_write_is_refused(xargs, store, n, says):
    params = types.SimpleNamespace(extra_args=xargs, n=n)
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        serve.check_capture(params, store)
    serve.check_request(xargs, {}, {})  # the capture keys are hookscope's: not refused as misspelt
