"""Tensor-parallel models (`hs.load(dir, tp=2)` under torchrun, gloo on the CPU) against the same
model unsharded, in float32.

One torchrun launch (two ranks) runs every verb on every family's model (tp_worker.py) and saves
what each rank got; each test here compares that with the unsharded model loaded in this process:
every point (hookscope's own unsharded table), the sharded ones also against a plain
`register_forward_hook` on a module path written here, kept shards as the rank's slice, grads at
three points (one whole, two sharded), and the logits under steer / head ablation / patch; each
rank's weights read as its slices alone.
Families: Llama, Qwen3 (q/k norms replicated), Gemma 3 (sandwich norms) and OLMo 2, whose plan
gathers q/k/v itself (`colwise_gather_output`): there q/k/v/z must come out whole, not gathered.
The Llama's weights also as a pickled `pytorch_model.bin` (transformers' own reader under `tp=`).

Tolerance: atol 1e-5, rtol 1e-5 (the differences seen are <= 3e-6: the all-reduce sums in
another order than one matmul).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import tp_worker as worker
from elastic_kit import torchrun_command
from safetensors.torch import load_file

import hookscope as hs
from hookscope.engines import tensor_parallel

HERE = Path(__file__).parent
CASES = ("llama", "qwen3", "gemma3_text", "olmo2")
# every point only: GPT-NeoX (its fused q|k|v, interleaved per head, split by View.split) and an MoE
# decoder (Mixtral: attention sharded, experts whole on each rank under TP alone)
POINTS_ONLY = ("neox_sequential", "mixtral")
PICKLED = "llama_bin"  # the Llama's weights as torch.save writes them (pytorch_model.bin), no safetensors
TOL = {"atol": 1e-5, "rtol": 1e-5}
N_HEADS = 4  # family_models' tiny decoders: 4 heads of 8, 2 kv heads, d_mlp 128
GENERATION_MAX_LENGTH = 33  # a config without the file gives None


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, dict, dict]]:
    """case -> (its directory, rank 0's results, rank 1's results), from one torchrun launch."""
    import family_models

    root = tmp_path_factory.mktemp("tp")
    dirs = []
    for case in CASES + POINTS_ONLY:
        model = family_models.build(case).float()
        model.generation_config.max_length = GENERATION_MAX_LENGTH  # held by generation_config.json alone
        model.save_pretrained(root / case)
        dirs.append(("points:" if case in POINTS_ONLY else "") + str(root / case))
    pickled = root / PICKLED
    pickled.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(root / "llama" / name, pickled / name)
    torch.save(load_file(root / "llama" / "model.safetensors"), pickled / "pytorch_model.bin")
    dirs.append(f"points:{pickled}")
    out = root / "out"
    out.mkdir()
    done = subprocess.run(
        [*torchrun_command(2), str(HERE / "tp_worker.py"), str(out), *dirs],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    load = lambda case, rank: torch.load(out / f"{case}.rank{rank}.pt", weights_only=False)  # noqa: E731
    return {case: (root / case, load(case, 0), load(case, 1)) for case in (*CASES, *POINTS_ONLY, PICKLED)}


@pytest.fixture(scope="module")
def unsharded(runs) -> dict[str, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    return {
        case: AutoModelForCausalLM.from_pretrained(
            directory, attn_implementation="eager", dtype=torch.float32
        ).eval()
        for case, (directory, _, _) in runs.items()
    }


def plain_hooks(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Block 1's sharded projections, read with plain torch hooks on module paths: the reference
    that does not go through hookscope's tables."""
    layer = model.model.layers[1]
    seen: dict[str, torch.Tensor] = {}

    def output(name):
        return lambda module, args, out: seen.__setitem__(name, out.detach().clone())

    def input_(name):
        return lambda module, args: seen.__setitem__(name, args[0].detach().clone())

    handles = [
        layer.self_attn.q_proj.register_forward_hook(output("attn.q")),
        layer.self_attn.o_proj.register_forward_pre_hook(input_("attn.z")),
        layer.mlp.gate_proj.register_forward_hook(output("mlp.pre")),
        layer.mlp.down_proj.register_forward_pre_hook(input_("mlp.post")),
        layer.register_forward_hook(
            output("resid_post")
        ),  # (a decoder layer returns a tensor in transformers 5)
    ]
    try:
        with torch.inference_mode():
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    b, p = ids.shape
    seen["attn.q"] = seen["attn.q"].view(b, p, N_HEADS, -1)
    seen["attn.z"] = seen["attn.z"].view(b, p, N_HEADS, -1)
    return seen


@pytest.mark.parametrize("case", (*CASES, *POINTS_ONLY, PICKLED))
def test_every_point_equals_the_unsharded_model(case, runs, unsharded):
    _, rank0, rank1 = runs[case]
    model = unsharded[case]
    want = hs.collect(model, worker.inputs(0), hs.arch.arch_of(model).names)
    assert set(rank0["acts"]) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(rank0["acts"][name], tensor, **TOL, msg=lambda m, n=name: f"{n}: {m}")
        assert torch.equal(rank1["acts"][name], rank0["acts"][name]), name  # both ranks hold the whole


@pytest.mark.parametrize("case", CASES)
def test_profile_reports_every_block_and_its_hooks_see_whole_points(case, runs, unsharded):
    """hs.profile on the sharded model: a row per block, as the unsharded model's profile has, and a
    user's hook at a sharded point gets the whole tensor (every head), equal to the unsharded one."""
    _, rank0, rank1 = runs[case]
    model = unsharded[case]
    want_rows = [(r.kind, r.name) for r in hs.profile(model, worker.inputs(0), steps=1, warmup=1).rows]
    want_z = hs.collect(model, worker.inputs(0), "blocks.1.attn.z")["blocks.1.attn.z"]
    for rank in (rank0, rank1):
        rows = rank["profiled"]["rows"]
        assert [r for r in rows if r[0] == "block"] == [r for r in want_rows if r[0] == "block"]
        assert ("hook", "blocks.1.attn.z") in rows
        torch.testing.assert_close(rank["profiled"]["hooked"], want_z, **TOL)


@pytest.mark.parametrize("case", CASES)
def test_sharded_points_gathered_and_kept_against_plain_hooks(case, runs, unsharded):
    _, rank0, rank1 = runs[case]
    ref = plain_hooks(unsharded[case], worker.inputs(0))
    for suffix in ("attn.q", "attn.z", "mlp.pre", "mlp.post", "resid_post"):
        name = f"blocks.1.{suffix}"
        torch.testing.assert_close(rank0["acts"][name], ref[suffix], **TOL)
        if rank0["layout"][name] is None:  # whole on each rank: nothing is kept apart
            assert name not in rank0["kept"]
            continue
        dim = -2 if suffix.startswith("attn") else -1  # a rank's heads, else its columns
        half = ref[suffix].shape[dim] // 2
        torch.testing.assert_close(rank0["kept"][name], ref[suffix].narrow(dim, 0, half), **TOL)
        torch.testing.assert_close(rank1["kept"][name], ref[suffix].narrow(dim, half, half), **TOL)
        if name in rank0["captured_kept"]:  # hs.capture(..., gather=False): the same slices
            for rank, got in enumerate((rank0, rank1)):
                want = ref[suffix].narrow(dim, rank * half, half)
                torch.testing.assert_close(got["captured_kept"][name], want, **TOL)
    # a raw module point on a split side is gathered too
    mlp_post, attn_z = worker.RAW_POINTS
    torch.testing.assert_close(rank1["raw"][mlp_post], ref["mlp.post"], **TOL)
    torch.testing.assert_close(rank1["raw"][attn_z], ref["attn.z"].flatten(-2), **TOL)
    # the heads asked for are global heads: 1 on rank 0, 2 on rank 1
    torch.testing.assert_close(rank0["heads"]["blocks.1.attn.z"], ref["attn.z"][:, :, [1, 2]], **TOL)
    # a model the user sharded with transformers' own tp_plan is read the same way
    for suffix in ("attn.z", "mlp.post", "resid_post"):
        torch.testing.assert_close(rank1["user_loaded"][f"blocks.1.{suffix}"], ref[suffix], **TOL)


def test_which_points_are_sharded_comes_from_the_plan(runs):
    """Llama's plan shards q/k/v/z and the MLP's inner points; OLMo 2's gathers q/k/v itself (its
    q/k norms need the whole), so there only the MLP's are sharded. `hs.points` says which slice."""
    sharded = {
        case: {
            n.split(".", 2)[2] for n, s in runs[case][1]["layout"].items() if s and n.startswith("blocks.0.")
        }
        for case in ("llama", "olmo2")
    }
    mlp = {"mlp.pre", "mlp.pre_linear", "mlp.post"}
    assert sharded["llama"] == {"attn.q", "attn.k", "attn.v", "attn.z", "attn.pattern", *mlp}
    assert sharded["olmo2"] == mlp
    labels = [dict(runs["llama"][rank]["points"]) for rank in (1, 2)]
    assert "heads 0-1 of 4" in labels[0]["blocks.0.attn.z"] and "gathered" in labels[0]["blocks.0.attn.z"]
    assert "heads 2-3 of 4" in labels[1]["blocks.0.attn.z"]
    assert "head 1 of 2" in labels[1]["blocks.0.attn.k"]
    assert "columns 64:128 of 128" in labels[1]["blocks.0.mlp.post"]
    assert "whole" in labels[0]["blocks.0.resid_post"] and "whole" in labels[0]["blocks.0.attn.out"]


@pytest.mark.parametrize("case", CASES)
def test_grads_at_three_points(case, runs, unsharded):
    _, rank0, rank1 = runs[case]
    want = hs.grads(unsharded[case], worker.inputs(0), worker.GRAD_POINTS, worker.loss)
    for name in worker.GRAD_POINTS:
        assert want[name].abs().max() > 1e-2, name  # a gradient that is there to get wrong
        for got in (rank0, rank1):
            torch.testing.assert_close(got["grads"][name], want[name], **TOL)
        # gather=False: each rank's slice of the gradient (its heads of attn.z, its columns of mlp.post)
        if rank0["layout"][name] is None:
            torch.testing.assert_close(rank0["kept_grads"][name], want[name], **TOL)
            continue
        dim = -2 if name.endswith("attn.z") else -1
        half = want[name].shape[dim] // 2
        for rank, got in enumerate((rank0, rank1)):
            torch.testing.assert_close(
                got["kept_grads"][name], want[name].narrow(dim, rank * half, half), **TOL
            )


@pytest.mark.parametrize("case", CASES)
def test_steer_ablate_patch_give_the_unsharded_logits(case, runs, unsharded):
    _, rank0, rank1 = runs[case]
    model, ids = unsharded[case], worker.inputs(0)
    clean = hs.collect(model, worker.inputs(1), ["blocks.0.mlp.post", "blocks.1.attn.z"])
    d_model = model.config.hidden_size
    edits = {
        "steer": hs.steer("blocks.1.resid_post", worker.steering_vector(d_model), scale=3.0),
        "ablate": hs.ablate("blocks.1.attn.z", heads=[0, 3]),  # one head on each rank
        "patch_mlp": hs.patch("blocks.0.mlp.post", clean),
        "patch_heads": hs.patch("blocks.1.attn.z", clean, heads=[1, 2], positions=[2, 3]),
    }
    with torch.inference_mode():
        plain = model(ids).logits
    for name, edit in edits.items():
        with hs.edit(model, edit), torch.inference_mode():
            want = model(ids).logits
        assert (want - plain).abs().max() > 1e-2, name  # the edit changes the logits
        torch.testing.assert_close(rank0["edited"][name], want, **TOL)
        torch.testing.assert_close(rank1["edited"][name], want, **TOL)


@pytest.mark.parametrize("case", ["llama", "gemma3_text"])
def test_generate_captures_and_ablates_as_unsharded(case, runs, unsharded):
    got = runs[case][1]["generated"]
    model = unsharded[case]
    # the reference: greedy steps by hand, heads 1 and 2 of block 0's attn.z zeroed by a plain hook
    # on o_proj's input (the model's own generate would pad the batch the same way: none here)
    o_proj = model.model.layers[0].self_attn.o_proj

    def ablate(module, args):
        z = args[0].unflatten(-1, (N_HEADS, -1)).clone()
        z[..., [1, 2], :] = 0
        return (z.flatten(-2),)

    handle = o_proj.register_forward_pre_hook(ablate)
    try:
        ids = worker.inputs(3)
        with torch.inference_mode():
            for _ in range(4):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert torch.equal(got["sequences"], ids)
        ref = plain_hooks(model, ids)  # (hs.generate runs a pass on the last token too)
    finally:
        handle.remove()
    torch.testing.assert_close(got["blocks.1.attn.z"], ref["attn.z"], **TOL)
    torch.testing.assert_close(got["blocks.1.mlp.post"], ref["mlp.post"], **TOL)


def test_gather_false_beside_heads_or_arch_refused(runs):
    refused = runs["llama"][1]["refused"]
    assert "heads are global indices" in refused["heads"]
    assert "give one of them" in refused["arch"]


@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_only_the_split_points_asked_for_are_gathered(case, runs):
    for rank in runs[case][1:]:
        assert rank["gathers"] == {name: n for name, (_, n) in worker.GATHER_ASKS.items()}


@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_selected_rows_equal_the_unsharded_selection(case, runs, unsharded):
    """positions= / token_mask= at sharded points (beside heads or a cast): the rows the unsharded
    model's `hs.collect` keeps with the same selection, on both ranks."""
    model = unsharded[case]
    for name, options in worker.selections().items():
        points = options.pop("points", worker.SELECTED_POINTS)
        want = hs.collect(model, worker.padded(0), points, **options)
        for rank in runs[case][1:]:
            got = rank["selected"][name]
            assert set(got) == set(want), name
            for point, tensor in want.items():
                tol = TOL if tensor.dtype == torch.float32 else {}  # bfloat16: torch's own tolerance
                said = f"{name}, {point}"
                torch.testing.assert_close(got[point], tensor, **tol, msg=lambda m, said=said: f"{said}: {m}")
    # the reference itself picked what was asked: block 1's z at the last real token of each row
    ref = plain_hooks(model, worker.padded(0)["input_ids"])
    last = runs[case][1]["selected"]["last"]["blocks.1.attn.z"]
    torch.testing.assert_close(last[0], ref["attn.z"][0, 6].bfloat16())
    torch.testing.assert_close(last[1], ref["attn.z"][1, 4].bfloat16())


@pytest.mark.parametrize("case", ["llama"])
def test_only_the_selected_rows_are_gathered(case, runs, unsharded):
    """Each rank sends its half of the selected rows alone: batch x rows x d_mlp / 2 float32s."""
    half = unsharded[case].config.intermediate_size // 2
    rows = {"every row": 7, "positions [1, 4]": 2, "last": 1}
    for rank in runs[case][1:]:
        assert rank["gathered_bytes"] == {name: 2 * n * half * 4 for name, n in rows.items()}


def test_what_the_directory_says_besides_the_weights_is_kept(runs):
    """A tensor-parallel load reads the weights through a state dict, not the directory: the
    directory's generation_config.json is read beside it, and the model says where it came from,
    as from_pretrained on the directory does."""
    directory, rank0, _ = runs["llama"]
    assert rank0["generation_max_length"] == GENERATION_MAX_LENGTH
    assert rank0["name_or_path"] == str(directory)


def test_a_pickled_checkpoint_is_sharded_too(runs, unsharded):
    """A pytorch_model.bin goes through transformers' own reader (torch.load's memory map): each
    rank still holds about half the weights (its pages of the map are another matter: docs/bigger.md)."""
    whole = sum(p.nbytes for p in unsharded[PICKLED].parameters())
    for rank in runs[PICKLED][1:]:
        assert rank["local_bytes"] < 0.75 * whole, (rank["local_bytes"], whole)


@pytest.mark.parametrize("case", CASES)
def test_each_rank_reads_only_its_slices(case, runs, unsharded):
    """No page of the checkpoint stays mapped in a rank (a memory map keeps every page a slice
    read resident), and each rank holds about half the weights (norms and, in some plans, the
    embeddings are whole on each rank)."""
    whole = sum(p.nbytes for p in unsharded[case].parameters())
    for rank in runs[case][1:]:
        assert rank["mapped"] == []
        assert rank["local_bytes"] < 0.75 * whole, (rank["local_bytes"], whole)
    assert runs[case][1]["local_bytes"] + runs[case][2]["local_bytes"] >= whole


# -- bad input, refused before any weight is read (no torchrun needed) -----------------------------


def test_tp_needs_torchrun(runs, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(hs.TensorParallelError, match="torchrun --nproc_per_node 2"):
        hs.load(str(runs["llama"][0]), tp=2, tokenizer=False)


def test_tp_must_divide_the_heads(runs):
    with pytest.raises(hs.TensorParallelError, match="does not divide the model's num_attention_heads"):
        hs.load(str(runs["llama"][0]), tp=3, tokenizer=False)


def test_tp_must_divide_the_processes(runs, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 3)
    with pytest.raises(hs.TensorParallelError, match="does not divide the 3 processes"):
        hs.load(str(runs["llama"][0]), tp=2, tokenizer=False)


def test_a_family_with_no_plan_refused(tiny_dirs):
    with pytest.raises(hs.TensorParallelError, match="no tensor-parallel plan for 'gpt2'"):
        hs.load(str(tiny_dirs["gpt2"]), tp=2, tokenizer=False)


def test_an_unsharded_model_has_no_kept_slices(unsharded):
    model, ids = unsharded["llama"], worker.inputs(0)
    assert set(tensor_parallel.layout(model).values()) == {None}
    asks = {
        "collect": lambda: hs.collect(model, ids, "blocks.0.attn.z", gather=False),
        "capture": lambda: hs.capture(model, "blocks.0.attn.z", gather=False),
        "grads": lambda: hs.grads(model, ids, "blocks.0.attn.z", worker.loss, gather=False),
    }
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        for verb, ask in asks.items():
            with pytest.raises(hs.TensorParallelError, match="is not sharded: every point is whole"):
                ask()
            assert not calls, f"{verb} ran the model before refusing"
    finally:
        handle.remove()
