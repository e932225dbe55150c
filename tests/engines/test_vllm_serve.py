"""`vllm serve` with hookscope's plugin (engines/vllm/serve.py), driven over HTTP by urllib: the
OpenAI-compatible server started as a subprocess on 127.0.0.1 with two named vectors at two points,
requests choosing them by name and scale in `vllm_xargs` (the server test_vllm_serve_store.py uses
too: conftest.py's `llama_server`).

- Requests sent at once, steered differently, each get the tokens and logprobs it gets alone.
- Each steered request equals Hugging Face's forward with `hs.steer` at the vector's point (teacher
  forcing on the tokens the server generated), and differs from the unsteered one.
- An unknown vector, a bad scale, a malformed key: HTTP 400 saying what to do.
Plus the checks that need no server: the vectors file and the server's flags, refused before work.
"""

from __future__ import annotations

import json
import threading
import types
import urllib.error
import urllib.request

import pytest
import torch
from gate import need

need("vllm")

from vllm_models import assert_close, hf_model  # noqa: E402
from vllm_server import post_json  # noqa: E402
from vllm_shared import ABLATIONS, VECTORS, vector  # noqa: E402

import hookscope as hs  # noqa: E402
from hookscope.engines.vllm import serve  # noqa: E402

PROMPT = [5, 17, 33, 64, 9, 40, 70, 12, 101, 3]
MAX_TOKENS = 6
# request -> its vllm_xargs
ASKED = {
    "plain": {},
    "joy": {"hookscope.steer.joy": 4.0},
    "calm": {"hookscope.steer.calm": -3.0},
    "both": {"hookscope.steer.joy": 2.0, "hookscope.steer.calm": 1.5},
}


@pytest.fixture(scope="module")
def server(llama_server):
    """The server test_vllm_serve_store.py shares (vllm_shared.start_llama_server): its store takes
    rows only from requests that ask for a capture, which none here does."""
    return llama_server


def post(server, xargs: dict, prompt=PROMPT) -> tuple[int, dict]:
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "logprobs": 0,
        "return_token_ids": True,
        "vllm_xargs": xargs,
    }
    return post_json(server.url, "/v1/completions", body)


def completion(server, xargs: dict) -> tuple[list[int], torch.Tensor]:
    status, body = post(server, xargs)
    assert status == 200, body
    choice = body["choices"][0]
    return choice["token_ids"], torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float64)


def at_once_as_alone(server, asked: dict) -> dict:
    """Each request of `asked` (name -> vllm_xargs) sent alone, then all at once (started together):
    each gets at once the tokens and logprobs it gets alone. Returns what each got alone."""
    alone = {name: completion(server, xargs) for name, xargs in asked.items()}
    together: dict = {}
    start = threading.Barrier(len(asked))

    def send(name: str) -> None:
        start.wait()
        together[name] = completion(server, asked[name])

    threads = [threading.Thread(target=send, args=(name,)) for name in asked]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in asked:
        assert together[name][0] == alone[name][0], name
        assert_close(together[name][1], alone[name][1], f"{name}: at once vs alone")
    return alone


@pytest.mark.slow  # one server start: 30-90 s
def test_requests_at_once_get_what_each_gets_alone_and_what_hugging_face_gets(server):
    alone = at_once_as_alone(server, ASKED)
    hf = hf_model(server.directory)
    for name, xargs in ASKED.items():
        tokens, got = alone[name]
        assert len(tokens) == MAX_TOKENS, name
        edits = [
            hs.steer(
                VECTORS[key.removeprefix("hookscope.steer.")][0],
                vector(key.removeprefix("hookscope.steer.")),
                scale=s,
            )
            for key, s in xargs.items()
        ]
        with torch.no_grad(), hs.edit(hf, *edits):  # teacher forcing on the server's tokens
            logprobs = hf(torch.tensor([PROMPT + tokens[:-1]])).logits[0].log_softmax(-1)
        rows = logprobs[len(PROMPT) - 1 :]
        assert rows.argmax(-1).tolist() == tokens, f"{name}: greedy tokens differ from Hugging Face's"
        want = torch.stack([rows[k, t] for k, t in enumerate(tokens)])
        assert_close(got, want, f"{name} vs Hugging Face", rel=1e-4)
    plain_tokens, plain_logprobs = alone["plain"]
    for name in ("joy", "calm", "both"):
        tokens, logprobs = alone[name]
        moved = tokens != plain_tokens or (logprobs - plain_logprobs).abs().max() > 1e-3
        assert moved, f"{name}: the steering changed nothing: the test cannot tell"


@pytest.mark.slow
@pytest.mark.parametrize(
    "xargs, says",
    [
        ({"hookscope.steer.fear": 1.0}, "unknown steering vector 'fear': this server has calm, joy"),
        ({"hookscope.steer.joy": "lots"}, "must be a finite number, got 'lots'"),
        ({"hookscope.stear.joy": 1.0}, "unknown hookscope argument 'hookscope.stear.joy'"),
    ],
)
def test_a_bad_request_gets_400_saying_what_to_do(server, xargs, says):
    status, body = post(server, xargs)
    assert status == 400, body
    assert says in json.dumps(body), body
    assert completion(server, ASKED["joy"])[0], "the server stopped serving after a 400"


@pytest.mark.slow
def test_the_server_lists_its_vectors(server):
    with urllib.request.urlopen(server.url + serve.ROUTE, timeout=30) as r:
        assert json.loads(r.read()) == {name: point for name, (point, _) in VECTORS.items()}


def hf_tokens(server, hf, edits: list) -> list[int]:
    """Hugging Face's greedy tokens with `edits` on every position (argmax of each forward)."""
    ids = list(PROMPT)
    with torch.no_grad(), hs.edit(hf, *edits):
        for _ in range(MAX_TOKENS):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT) :]


@pytest.mark.slow
def test_an_ablated_and_a_steered_request_at_once_get_what_each_gets_alone_and_from_hugging_face(server):
    asked = {"ablated": {"hookscope.ablate.no_head_1": 1}, "steered": {"hookscope.steer.joy": 4.0}}
    alone = at_once_as_alone(server, asked)
    hf = hf_model(server.directory)
    (point, heads) = ABLATIONS["no_head_1"]
    assert alone["ablated"][0] == hf_tokens(server, hf, [hs.ablate(point, heads=heads)])
    assert alone["steered"][0] == hf_tokens(
        server, hf, [hs.steer(VECTORS["joy"][0], vector("joy"), scale=4.0)]
    )
    plain = hf_tokens(server, hf, [])
    assert alone["ablated"][0] != plain, "the ablation changed no token: the test cannot tell"
    assert completion(server, {"hookscope.ablate.no_head_1": 0})[0] == plain, "0 asks for no ablation"


@pytest.mark.slow
def test_an_unknown_ablation_gets_400_listing_the_known_ones(server):
    status, body = post(server, {"hookscope.ablate.no_head_9": 1})
    assert status == 400, body
    assert "unknown ablation 'no_head_9': this server has no_head_1" in json.dumps(body), body
    status, body = post(server, {"hookscope.ablate.no_head_1": 2})
    assert status == 400 and "takes 1 (ablate) or 0" in json.dumps(body), body
    with urllib.request.urlopen(server.url + serve.ABLATIONS_ROUTE, timeout=30) as r:
        assert json.loads(r.read()) == {name: point for name, (point, _) in ABLATIONS.items()}


# ---- the checks that need no server ----


def test_a_vectors_file_without_points_or_of_matrices_is_refused(tmp_path):
    from safetensors.torch import save_file

    with pytest.raises(hs.EngineError, match="no vectors file"):
        serve.read_vectors(tmp_path / "missing.safetensors")
    save_file({"joy": torch.zeros(256), "calm": torch.zeros(256)}, tmp_path / "a", metadata={"joy": "embed"})
    with pytest.raises(hs.EngineError, match="gives no point for calm"):
        serve.read_vectors(tmp_path / "a")
    save_file({"joy": torch.zeros(2, 256)}, tmp_path / "b", metadata={"joy": "embed"})
    with pytest.raises(hs.EngineError, match="joy in .* are not vectors"):
        serve.read_vectors(tmp_path / "b")
    (tmp_path / "c").write_bytes(b"\x00" * 64)
    with pytest.raises(hs.EngineError, match="is not a safetensors file"):
        serve.read_vectors(tmp_path / "c")


def test_an_ablation_in_the_vectors_file_is_read_as_hs_ablate(tmp_path):
    from safetensors.torch import save_file

    meta = {"heads": "ablate:blocks.0.attn.z", "whole": "ablate:blocks.1.mlp.out"}
    save_file(
        {"heads": torch.tensor([1, 3]), "whole": torch.zeros(0, dtype=torch.int64)},
        tmp_path / "a",
        metadata=meta,
    )
    assert serve.read_vectors(tmp_path / "a") == {
        "heads": hs.ablate("blocks.0.attn.z", heads=[1, 3]),
        "whole": hs.ablate("blocks.1.mlp.out"),
    }
    save_file({"heads": torch.tensor([1.0])}, tmp_path / "b", metadata={"heads": "ablate:blocks.0.attn.z"})
    with pytest.raises(hs.EngineError, match="lists the heads it zeroes as integers"):
        serve.read_vectors(tmp_path / "b")


def config(processors=(serve.CHECK,), additional=None, prefix_caching=False):
    """A VllmConfig's fields the plugin reads at start."""
    return types.SimpleNamespace(
        model_config=types.SimpleNamespace(
            logits_processors=list(processors), enforce_eager=True, hf_config=None
        ),
        additional_config=additional
        if additional is not None
        else {"hookscope": {"vectors": "v.safetensors"}},
        cache_config=types.SimpleNamespace(enable_prefix_caching=prefix_caching),
        parallel_config=types.SimpleNamespace(
            worker_extension_cls="", tensor_parallel_size=1, pipeline_parallel_size=1
        ),
    )


@pytest.mark.parametrize(
    "settings, says",
    [
        ({"processors": ()}, "--logits-processors hookscope.engines.vllm.serve:RequestCheck"),
        ({"additional": {}}, "--additional-config"),
        ({"prefix_caching": True}, "--no-enable-prefix-caching"),
        ({}, "--worker-extension-cls"),
    ],
)
def test_the_plugin_refuses_a_server_missing_a_flag_before_any_worker_call(tmp_path, settings, says):
    import asyncio

    from safetensors.torch import save_file

    vectors = tmp_path / "v.safetensors"
    save_file({"joy": torch.zeros(256)}, vectors, metadata={"joy": "blocks.0.resid_post"})
    settings = {"additional": {"hookscope": {"vectors": str(vectors)}}, **settings}
    calls = []

    async def collective_rpc(method, args=()):
        calls.append(method)

    client = types.SimpleNamespace(vllm_config=config(**settings), collective_rpc=collective_rpc)
    with pytest.raises(hs.EngineError, match=says):
        asyncio.run(serve.Plugin().init_state(client, types.SimpleNamespace(), None))
    assert calls == []
