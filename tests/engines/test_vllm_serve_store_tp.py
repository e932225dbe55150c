"""`vllm serve --tensor-parallel-size 2` writing a hookscope store (engines/vllm/capture_store.py):
the first rank writes, every rank takes part in the gathers of the points vLLM splits across them
(`attn.z`, the input of the row-parallel o_proj), and each request's rows, prompt and generated,
equal hookscope's Hugging Face `hs.generate` of its prompt alone (which the one-rank server's rows
equal: test_vllm_serve_store.py), float32, to 1e-5 of the reference's largest value.

vLLM's CPU workers bind their threads one NUMA node per rank unless told which CPUs to use: on a
one-node machine, VLLM_CPU_OMP_THREADS_BIND gives each rank its own CPU ("0|1").
"""

from __future__ import annotations

import pytest
import torch
from gate import need

need("vllm")

from vllm_models import assert_close, hf_model, save  # noqa: E402
from vllm_server import completion, send_at_once, start, stop  # noqa: E402
from vllm_shared import key_of  # noqa: E402

import hookscope as hs  # noqa: E402
from hookscope.engines.vllm import serve  # noqa: E402

pytestmark = pytest.mark.slow  # one server of three processes: 2-4 minutes to start on 2 cores

POINTS = ["blocks.0.attn.z", "blocks.1.resid_post", "blocks.0.mlp.out"]
NEW = 5
ASKED = {"ranks_a": [5, 17, 33, 64, 9, 40, 70], "ranks_b": [8, 2, 77, 31, 5, 19, 44, 90, 6, 13, 58, 21]}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_store_tp")
    directory = save("llama", tmp / "llama", seed=6)
    out = tmp / "acts"
    flags = [*serve.serve_flags(store=out, points=POINTS, shard_rows=1000), "--tensor-parallel-size", "2"]
    answers: dict = {}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        proc, url, _ = start(directory, flags, tmp / "server.log")
    try:
        bodies = {
            name: completion(directory, prompt, NEW, {"hookscope.capture": 1, "hookscope.capture_id": name})
            for name, prompt in ASKED.items()
        }
        for t in send_at_once(url, bodies, answers):
            t.join()
    finally:
        stop(proc)
    return directory, out, answers


def test_two_ranks_write_one_store_equal_to_hugging_face(served):
    directory, out, answers = served
    for name in ASKED:
        assert answers[name][0] == 200, answers[name]
    store = hs.open_store(out)
    store.verify()
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["shard-r000-000000.safetensors"], (
        "one writer, the first rank's"
    )
    hf = hf_model(directory)
    docs, total = store.tensor("doc_ids"), 0
    for name, prompt in ASKED.items():
        want = hs.generate(hf, torch.tensor([prompt]), POINTS, max_new_tokens=NEW, do_sample=False)
        n = want.sequences.shape[1] - 1
        total += n
        mine = docs == key_of(name)
        assert int(mine.sum()) == n, f"{name}: {int(mine.sum())} rows, not {n}"
        assert store.tensor("token_ids")[mine].tolist() == want.sequences[0, :n].tolist(), name
        for point in POINTS:
            assert_close(store.tensor(point)[mine], want[point][0, :n], f"{name} {point}")
    assert len(store) == total
