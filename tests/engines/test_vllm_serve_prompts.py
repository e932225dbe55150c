"""`vllm serve` writing a store of the prompts' rows only (`"generated": false` beside the store),
on a server of its own (vllm_shared.start_llama_server with generated=False: the shared one keeps
the generated tokens' rows too, which test_vllm_serve_store.py reads). A server start of its own:
`HOOKSCOPE_TEST_LONG=1 scripts/test-all vllm` runs this file.

Two requests that ask for a capture (one by the id vLLM gives it, one under its own
`hookscope.capture_id`) and one that does not, sent at once, each generating: after the server
stops, the store holds exactly the asking requests' prompt rows, each equal to hookscope's Hugging
Face `hs.collect` of that prompt alone on the same checkpoint, in position order with the prompt's
token ids, no row of a generated token (the `generated` column 0 throughout), and the rows it held
before the server started.
"""

from __future__ import annotations

import pytest
import torch
from gate import need

need("vllm")

from vllm_models import assert_close, hf_model  # noqa: E402
from vllm_server import completion, send_at_once  # noqa: E402
from vllm_shared import CAPTURE_REQUESTS as ASKED  # noqa: E402
from vllm_shared import EARLIER, key_of, start_llama_server  # noqa: E402
from vllm_shared import STORE_POINTS as POINTS  # noqa: E402

import hookscope as hs  # noqa: E402

NEW = 6  # tokens each request generates: rows the store must not hold


@pytest.fixture(scope="module")
def served(shared_vllm, tmp_path_factory):
    """The requests sent at once and answered, then the server stopped (its last shard committed):
    (answers, the server). Started through `shared_vllm`, so that no shared engine is up beside it."""
    root = tmp_path_factory.mktemp("prompts_only_server")
    server = shared_vllm.get("prompts_only_server", lambda: start_llama_server(root, generated=False))
    answers: dict = {}
    bodies = {
        name: completion(server.directory, prompt, NEW, xargs) for name, (prompt, xargs) in ASKED.items()
    }
    try:
        for thread in send_at_once(server.url, bodies, answers):
            thread.join()
    finally:
        shared_vllm.release("prompts_only_server")
    return answers, server


@pytest.mark.slow  # a server start (30-90 s) of its own
def test_a_prompts_only_store_holds_each_asking_request_s_prompt_rows_as_hugging_face_s_collect(served):
    answers, server = served
    for name in ASKED:
        status, body = answers[name]
        assert status == 200, (name, body)
        # two tokens or more: the model ran a generated one, whose row the store must not hold
        assert body["usage"]["completion_tokens"] >= 2, (name, body["usage"])
    store = hs.open_store(server.out)
    store.verify()
    assert store.manifest.settings["generated"] is False
    docs, positions = store.tensor("doc_ids"), store.tensor("positions")
    found = {
        "by_id": key_of(answers["by_id"][1]["id"] + "-0"),  # the completion's prompt 0
        "mine": key_of("mine"),
        "plain": key_of(answers["plain"][1]["id"] + "-0"),
    }
    assert len(set(found.values())) == 3
    assert int((docs == key_of(EARLIER[0])).sum()) == EARLIER[1], "the rows held before the start are gone"
    assert not (docs == found["plain"]).any(), "a request that did not ask has rows in the store"
    assert not store.tensor("generated").bool().any(), "a generated token's row in a prompts-only store"

    hf = hf_model(server.directory)
    for name in ("by_id", "mine"):
        prompt = ASKED[name][0]
        mine = docs == found[name]
        assert int(mine.sum()) == len(prompt), (
            f"{name}: {int(mine.sum())} rows for a {len(prompt)}-token prompt"
        )
        assert positions[mine].tolist() == list(range(len(prompt))), f"{name}: not in position order"
        assert store.tensor("token_ids")[mine].tolist() == prompt, name
        want = hs.collect(hf, torch.tensor([prompt]), POINTS)
        for point in POINTS:  # float32, 1e-5 of the largest value
            assert_close(store.tensor(point)[mine], want[point][0], f"{name} {point}")
    assert len(store) == EARLIER[1] + sum(len(ASKED[name][0]) for name in ("by_id", "mine"))
