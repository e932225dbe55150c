"""`vllm serve` writing the captures of the requests that ask into a hookscope store
(engines/vllm/capture_store.py), driven over HTTP by urllib on 127.0.0.1.

- Three requests sent at once, two asking for a capture (one by the id vLLM gives it, one under its
  own `hookscope.capture_id`), one not: after the server stops, the store holds the two requests'
  rows, prompt and generated tokens (all but the last sampled, which the engine never runs), each
  equal to hookscope's Hugging Face `hs.generate` of that prompt alone and to the offline engine's
  `hs.generate` of it alone, found by the id the client has, the `generated` column 1 exactly on the
  generated tokens' rows; the third has none. The store was started before the server by another
  run of the same settings: the server appends to it, and its rows are still there.
- The server stopped with SIGTERM to its API server (`kill PID`, a service manager) while a long
  request generates: vLLM drains it (finishes it within --shutdown-timeout), and its rows are
  written whole, equal to Hugging Face's `hs.generate` of its prompt alone.
- A malformed capture request gets HTTP 400.
Plus the checks that need no server: a store of other points refused before any worker call, and a
capture asked of a server with no store.
"""

from __future__ import annotations

import os
import signal
import types

import pytest
import torch
from gate import need

need("vllm")

from vllm_models import assert_close, engine, hf_model, save, shut  # noqa: E402
from vllm_server import completion, post_json, send_at_once, send_generating, wait_closed  # noqa: E402
from vllm_shared import CAPTURE_REQUESTS as ASKED  # noqa: E402
from vllm_shared import EARLIER, key_of, start_store, vllm_config  # noqa: E402
from vllm_shared import STORE_POINTS as POINTS  # noqa: E402

import hookscope as hs  # noqa: E402
from hookscope.engines.vllm import serve  # noqa: E402

NEW = 6  # tokens each request generates (max_tokens)
# a request still generating when the API server gets SIGTERM: prompt, max_tokens (within
# --max-model-len 256; each step slowed to 20 ms, below, so that it runs for 4 s or more)
DRAINED = ([6, 81, 14, 3, 57, 22, 9, 140, 35, 7, 66, 18], 190)


@pytest.fixture(scope="module")
def served(llama_server, shared_vllm):
    """The three requests sent at once and a bad one, answered; a long one sent, and the server
    stopped (SIGTERM to the API server) while it generates. The server test_vllm_serve.py shares
    (vllm_shared.start_llama_server: its store holds EARLIER's rows, shards of 1000 rows, so every
    row the server writes is committed when it stops); none of that file's requests asks for a
    capture, so the store holds only the rows of this file's requests besides EARLIER's."""
    server = llama_server
    url, directory, proc = server.url, server.directory, server.proc
    answers: dict = {}
    try:
        for t in send_at_once(
            url, {name: completion(directory, ASKED[name][0], NEW, ASKED[name][1]) for name in ASKED}, answers
        ):
            t.join()
        bad = {"model": str(directory), "prompt": [5, 6], "max_tokens": 1}
        answers["bad"] = post_json(
            url, "/v1/completions", {**bad, "vllm_xargs": {"hookscope.capture_id": "x"}}
        )
        # its steps slowed (tests/kit/vllm_slow_steps.py): still running when SIGTERM comes
        drained = {"hookscope.capture": 1, "hookscope.capture_id": "drained", "test.step_s": 0.02}
        drain = send_generating(url, completion(directory, *DRAINED, drained), proc)
        os.kill(proc.pid, signal.SIGTERM)  # the API server alone, as `kill PID` or a service manager
        wait_closed(server.out)
    finally:
        shared_vllm.release("llama_server")  # its whole group, whatever SIGTERM left
    drain.join()
    return types.SimpleNamespace(
        answers=answers, out=server.out, directory=directory, log=server.log, offline=offline(directory)
    )


def offline(directory) -> dict:
    """The asking requests run alone through the offline engine's `hs.generate` (in this process)."""
    llm = engine(directory, in_process=True, enable_prefix_caching=False)
    try:
        return {
            name: hs.generate(llm, [ASKED[name][0]], POINTS, max_new_tokens=NEW)[0]
            for name in ("by_id", "mine")
        }
    finally:
        shut(llm)


@pytest.mark.slow  # the shared server (a start of 30-90 s if no file before started it), an offline engine
def test_the_store_holds_each_asking_request_s_rows_as_its_generation_alone_gives_them(served):
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

    hf = hf_model(served.directory)
    want_rows = EARLIER[1] + int((docs == key_of("drained")).sum())  # (its own test checks them)
    for name in ("by_id", "mine"):
        prompt = ASKED[name][0]
        want = hs.generate(hf, torch.tensor([prompt]), POINTS, max_new_tokens=NEW, do_sample=False)
        # every token the engine ran: the last one sampled never runs (Hugging Face's generate runs it)
        n = want.sequences.shape[1] - 1
        assert n > len(prompt), f"{name}: Hugging Face generated nothing to compare"
        want_rows += n
        mine = docs == found[name]
        assert int(mine.sum()) == n, f"{name}: {int(mine.sum())} rows, not the {n} tokens the engine ran"
        assert positions[mine].tolist() == list(range(n)), f"{name}: not in position order"
        assert store.tensor("token_ids")[mine].tolist() == want.sequences[0, :n].tolist(), name
        generated = [0] * len(prompt) + [1] * (n - len(prompt))
        assert store.tensor("generated")[mine].tolist() == generated, f"{name}: prompt / generated rows"
        alone = served.offline[name]
        assert alone.sequences.tolist() == want.sequences.tolist(), f"{name}: the offline engine's tokens"
        for point in POINTS:
            got = store.tensor(point)[mine]
            assert_close(got, want[point][0, :n], f"{name} {point}")  # float32, 1e-5 of the largest value
            assert_close(got, alone[point][0, :n], f"{name} {point}, offline engine")
    assert len(store) == want_rows, f"{len(store)} rows, not the earlier {EARLIER[1]} and the requests'"
    assert store.manifest.settings["generated"] is True


@pytest.mark.slow
def test_a_request_generating_at_sigterm_is_drained_and_written_whole(served):
    """vLLM finished it (drained, within --shutdown-timeout): its rows as its generation alone gives."""
    assert "draining in-flight requests count=1" in served.log.read_text(), "no request was in flight"
    tokens, new = DRAINED
    want = hs.generate(
        hf_model(served.directory), torch.tensor([tokens]), POINTS, max_new_tokens=new, do_sample=False
    )
    store = hs.open_store(served.out)
    mine = store.tensor("doc_ids") == key_of("drained")
    n = want.sequences.shape[1] - 1
    assert int(mine.sum()) == n, f"the drained request: {int(mine.sum())} rows, not {n}"
    assert store.tensor("token_ids")[mine].tolist() == want.sequences[0, :n].tolist()
    assert store.tensor("generated")[mine].tolist() == [0] * len(tokens) + [1] * (n - len(tokens))
    for point in POINTS:
        assert_close(store.tensor(point)[mine], want[point][0, :n], f"drained {point}")


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
    # a store of the generated tokens' rows, reopened for the prompts' only: refused, naming it
    prompts_only = serve.store_options(
        {"store": str(tmp_path / "acts"), "points": POINTS, "generated": False}
    )
    with pytest.raises(hs.StoreError, match=r"generated: stored true, given false"):
        serve.store_call(vllm_config(directory), prompts_only)
    with pytest.raises(hs.EngineError, match=r"generated is true .* or false, got 'no'"):
        serve.store_options({"store": "acts", "points": POINTS, "generated": "no"})


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
