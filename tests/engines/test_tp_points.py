"""`hs.load(dir, tp=2, points=[...])` on two ranks (children of the fork server with torchrun's
environment, gloo on the CPU): each rank holds its slices of only the embeddings and the blocks the
points need; `hs.collect` / `hs.capture(...).run` give what the unsharded model gives, `hs.points`
and `hs.profile` run as far as the weights go, and a point past them is refused, as with `points=`
in one process; `hookscope extract --tp 2 --points ...` loads only those weights too.

References, none read from the code under test: the unsharded model (transformers' own
`from_pretrained`, float32), read by hookscope's unsharded table and by plain hooks on module paths
written here; which parameters a point at block 1 needs (the embeddings, blocks 0 and 1), written
here; how transformers' plan splits them (every projection's weight, q / k / v's biases and the
embedding's rows halved, norms whole), written here; one unsharded process's extraction of the
same corpus.

Tolerance: atol 1e-5, rtol 1e-5 (as tests/engines/test_tensor_parallel.py: the all-reduce sums the
ranks' halves in another order than one matmul).
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch
import tp_points_worker as worker
from elastic_kit import in_batch_order
from forkserver import ForkServer

import hookscope as hs
from hookscope.extract import ExtractConfig, extract
from hookscope.store import open_store
from hookscope.testing import save_tiny

CASES = ("llama", "gemma3_text")
N_LAYERS = 4
N_HEADS = 4  # family_models' tiny decoders: 4 heads of 8
TOL = {"atol": 1e-5, "rtol": 1e-5}
NEEDED = re.compile(r"model\.(embed_tokens|layers\.[01])\.")  # blocks.1's points: embeddings, blocks 0-1
# what transformers' plan splits over the ranks: each projection's weight, q / k / v's biases, and the
# input embedding's rows (its `embedding_rowwise`, added to every plan for an `nn.Embedding`)
SPLIT_PARAMS = re.compile(r"_proj\.weight$|[qkv]_proj\.bias$|embed_tokens\.weight$")
# what `blocks.0.attn.out` is a module's output of: after the post-norm on Gemma 3 (sandwich norms)
ATTN_OUT = {"llama": "self_attn.o_proj", "gemma3_text": "post_attention_layernorm"}
EXTRACT_POINTS = ["blocks.1.attn.z", "blocks.1.mlp.post", "blocks.1.resid_post"]


def extract_settings(paths: dict[str, Path], out: Path) -> dict:
    return {
        "out": str(out),
        "model": str(paths["tokenized"]),
        "data": str(paths["corpus"]),
        "points": EXTRACT_POINTS,
        "context": 16,
        "batch_size": 2,
        "dtype": "float32",
    }


def extract_cli(paths: dict[str, Path], out: Path) -> list[str]:
    args = ["extract", str(paths["tokenized"]), "--out", str(out), "--data", str(paths["corpus"])]
    args += ["--points", ",".join(EXTRACT_POINTS), "--context", "16", "--batch-size", "2"]
    return [*args, "--dtype", "float32", "--no-progress", "--tp", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every model directory, what each rank saved, each rank's extraction, and the unsharded
    process's extraction (the reference)."""
    import family_models

    root = tmp_path_factory.mktemp("tpp")
    paths = {case: root / case for case in CASES}
    for case in CASES:
        family_models.build(case, num_hidden_layers=N_LAYERS).float().save_pretrained(paths[case])
    paths["tokenized"] = save_tiny("llama", root / "tokenized", d_model=64, n_layers=N_LAYERS, n_heads=4)
    rng = random.Random(0)
    words = "the a model layer head token sum rank shard group batch row store".split()
    lines = (" ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) for _ in range(20))
    paths["corpus"] = root / "corpus.txt"
    paths["corpus"].write_text("\n".join(lines) + "\n")
    out = root / "out"
    out.mkdir()
    ranks = ForkServer.shared().call_ranks(
        2,
        "tp_points_worker:run",
        out=str(out),
        cases={case: str(paths[case]) for case in CASES},
        extract_args=extract_cli(paths, root / "tp2"),
    )
    assert all(r.status == 0 for r in ranks), [r.log[-3000:] for r in ranks]
    extract(ExtractConfig(**extract_settings(paths, root / "reference"), progress=False))
    load = lambda case, rank: torch.load(out / f"{case}.rank{rank}.pt", weights_only=False)  # noqa: E731
    return {
        "paths": paths,
        "ranks": {case: (load(case, 0), load(case, 1)) for case in CASES},
        "extracted": [r.result for r in ranks],
        "stores": (root / "tp2", root / "reference"),
    }


@pytest.fixture(scope="module")
def unsharded(runs) -> dict[str, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    return {
        case: AutoModelForCausalLM.from_pretrained(
            runs["paths"][case], attn_implementation="eager", dtype=torch.float32
        ).eval()
        for case in (*CASES, "tokenized")
    }


def plain_hooks(model: torch.nn.Module, case: str, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The points, read with plain torch hooks on module paths written here."""
    layers = model.model.layers
    seen: dict[str, torch.Tensor] = {}

    def output(name):
        return lambda module, args, out: seen.__setitem__(name, out.detach().clone())

    def input_(name):
        return lambda module, args: seen.__setitem__(name, args[0].detach().clone())

    handles = [
        layers[0].get_submodule(ATTN_OUT[case]).register_forward_hook(output("blocks.0.attn.out")),
        layers[1].self_attn.o_proj.register_forward_pre_hook(input_("blocks.1.attn.z")),
        layers[1].mlp.down_proj.register_forward_pre_hook(input_("blocks.1.mlp.post")),
        layers[1].register_forward_hook(output("blocks.1.resid_post")),
    ]
    try:
        with torch.inference_mode():
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    seen["blocks.1.attn.z"] = seen["blocks.1.attn.z"].unflatten(-1, (N_HEADS, -1))
    return seen


def on_rank(name: str, param: torch.Tensor, rank: int | None) -> int:
    """A parameter's bytes on `rank` of 2 (None: the whole): a split one holds its `torch.chunk` of
    the rows (an odd vocabulary: 221 and 220 of 441; the projections' dims are even)."""
    if rank is None or not SPLIT_PARAMS.search(name):
        return param.nbytes
    return param.nbytes // len(param) * len(torch.arange(len(param)).chunk(2)[rank])


def needed_bytes(model: torch.nn.Module, rank: int | None) -> dict[str, int]:
    """The parameters a point at block 1 needs -> their bytes on `rank` of 2 (None: whole)."""
    return {name: on_rank(name, p, rank) for name, p in model.named_parameters() if NEEDED.match(name)}


@pytest.mark.slow  # two ranks, each loading four models and extracting
@pytest.mark.parametrize("case", CASES)
def test_the_points_equal_the_unsharded_model_on_both_ranks(case, runs, unsharded):
    model, ids = unsharded[case], worker.inputs(0)
    want = hs.collect(model, ids, worker.POINTS)
    plain = plain_hooks(model, case, ids)
    for rank in runs["ranks"][case]:
        for verb in ("acts", "captured"):  # hs.collect, and hs.capture(...).run stopped after block 1
            for name in worker.POINTS:
                said = f"{verb} {name}"
                torch.testing.assert_close(
                    rank[verb][name], want[name], **TOL, msg=lambda m, s=said: f"{s}: {m}"
                )
                torch.testing.assert_close(
                    rank[verb][name], plain[name], **TOL, msg=lambda m, s=said: f"{s}: {m}"
                )
    # gather=False: each rank's half of the heads, of the MLP's columns
    for index, rank in enumerate(runs["ranks"][case]):
        z, post = plain["blocks.1.attn.z"], plain["blocks.1.mlp.post"]
        torch.testing.assert_close(rank["kept"]["blocks.1.attn.z"], z.narrow(-2, index * 2, 2), **TOL)
        half = post.shape[-1] // 2
        torch.testing.assert_close(
            rank["kept"]["blocks.1.mlp.post"], post.narrow(-1, index * half, half), **TOL
        )


@pytest.mark.slow  # two ranks, each loading four models and extracting
@pytest.mark.parametrize("case", CASES)
def test_each_rank_holds_half_of_the_needed_blocks_alone(case, runs, unsharded):
    """Exactly the embeddings and blocks 0-1 left `meta`, each split parameter halved; the same rank
    under tp=2 alone holds more: the same halves of blocks 0-1, and blocks 2-3, the final norm
    and the head too."""
    model = unsharded[case]
    whole = sum(needed_bytes(model, None).values())
    for index, rank in enumerate(runs["ranks"][case]):
        want = needed_bytes(model, index)
        held, held_alone = rank["held"], rank["whole_held"]
        assert held == want
        assert sum(held.values()) < 0.75 * whole, (sum(held.values()), whole)
        assert {n: held_alone[n] for n in want} == want  # the same slices as tp=2 alone
        assert sum(held.values()) < sum(held_alone.values()), (sum(held.values()), sum(held_alone.values()))
        assert set(held_alone) == {name for name, _ in model.named_parameters()}


@pytest.mark.slow  # two ranks, each loading four models and extracting
@pytest.mark.parametrize("case", CASES)
def test_a_point_after_the_blocks_loads_every_slice(case, runs, unsharded):
    """points=["logits"]: each rank holds what tp=2 alone holds, and the logits are the unsharded
    model's."""
    model = unsharded[case]
    with torch.inference_mode():
        want = model(worker.inputs(0)).logits
    for rank in runs["ranks"][case]:
        assert rank["through_held"] == rank["whole_held"]
        torch.testing.assert_close(rank["logits"], want, **TOL)


@pytest.mark.slow  # two ranks, each loading four models and extracting
@pytest.mark.parametrize("case", CASES)
def test_a_point_past_the_loaded_blocks_is_refused(case, runs):
    for rank in runs["ranks"][case]:
        said = rank["refused"]
        assert said is not None and "blocks.2.resid_post needs weights this model does not have" in said
        assert "blocks 0-1 of 4" in said and "points=[" in said and "without points=" in said
        assert rank["pass_refused"] is not None and "reached model.layers.2" in rank["pass_refused"]
        for verb in ("grads_refused", "generate_refused"):  # they need the model's output
            assert (
                rank[verb] is not None and "blocks 0-1 of 4" in rank[verb] and "without points=" in rank[verb]
            )


@pytest.mark.slow  # two ranks, each loading four models and extracting
@pytest.mark.parametrize("case", CASES)
def test_points_and_profile_run_as_far_as_the_weights_go(case, runs, unsharded):
    """`hs.points(model, ids)` measures the points blocks 0-1 reach, split ones at their whole
    shape (the unsharded model's plain hooks), the rest unmeasured; `hs.profile` gives rows for
    blocks 0 and 1 alone."""
    model = unsharded[case]
    plain = plain_hooks(model, case, worker.inputs(0))
    names = {info.name for info in hs.points(model)}
    for rank in runs["ranks"][case]:
        shapes = rank["shapes"]
        assert set(shapes) == names
        for name in worker.POINTS:
            assert shapes[name] == tuple(plain[name].shape), name
        assert shapes["blocks.2.resid_pre"] is None and shapes["logits"] is None
        assert rank["profiled"] == ["blocks.0", "blocks.1"]


@pytest.mark.slow  # two ranks, each loading four models and extracting
def test_extract_with_tp_loads_only_what_its_points_need(runs, unsharded):
    """`hookscope extract --tp 2 --points` (blocks.1's points of 4 blocks): each rank ran a model
    holding its halves of the embeddings and blocks 0-1 alone, and the store's rows are
    the unsharded process's."""
    for index, result in enumerate(runs["extracted"]):
        assert result["code"] == 0
        assert result["held"] == needed_bytes(unsharded["tokenized"], index)
    got_path, want_path = runs["stores"]
    got, reference = in_batch_order(open_store(got_path, verify=True)), in_batch_order(open_store(want_path))
    assert got.keys() == reference.keys()
    for name in ("token_ids", "positions", "seq_ids", "doc_ids"):
        assert torch.equal(got[name], reference[name]), name
    for name in EXTRACT_POINTS:
        assert got[name].abs().max() > 0.1, name  # values there to get wrong
        torch.testing.assert_close(got[name], reference[name], **TOL)
