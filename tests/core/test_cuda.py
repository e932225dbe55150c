"""The equality suites on a CUDA device (issue: "run it where users run it").

Every test here takes a `device`. The "cpu" variant runs in the default suite, so the code of this
file is exercised on every machine; the "cuda" variant skips with a stated reason where there is no
CUDA device, and `scripts/gpu-suite` runs the whole file on one with HOOKSCOPE_REQUIRE=cuda (then a
missing device is a failure, not a skip). References are independent of hookscope: plain
`register_forward_hook` captures, `torch.autograd.grad`, hand-written edit hooks, the model's own
forward. On CUDA, hookscope and the reference run the same kernels in the same order, so values are
compared exactly; only the compiled paths (other kernels) use a tolerance, stated where used.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from gate import skip_unless
from helpers import first, plain_hooks, token_ids
from torch import Tensor, nn

import hookscope as hs
from hookscope.errors import PointNotLoadedError
from hookscope.hooks import hook_count
from hookscope.testing import save_tiny

pytestmark = pytest.mark.cuda
# the GPU suite (HOOKSCOPE_REQUIRE=cuda) must never pass by skipping: there a missing device is an error
cuda_only = skip_unless("cuda")
DEVICES = ["cpu", pytest.param("cuda", marks=cuda_only)]
SIZE = {"d_model": 64, "n_layers": 3, "n_heads": 4, "context": 64}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cuda-models")
    return {family: save_tiny(family, root / family, **SIZE) for family in ("gpt2", "llama")}


def load(model_dirs, family: str, device: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    return hs.load(str(model_dirs[family]), device=device, dtype=dtype).model


def blocks_of(model: nn.Module) -> list[nn.Module]:
    base = getattr(model, "transformer", None) or model.model
    return list(getattr(base, "h", None) or base.layers)


def plain_resid_post(model: nn.Module, ids: Tensor) -> list[Tensor]:
    """The reference: every block's output through a bare torch forward hook."""
    blocks = blocks_of(model)
    got = plain_hooks(
        model, {i: (b, "output", first) for i, b in enumerate(blocks)}, lambda: model(ids, use_cache=False)
    )
    return [got[i] for i in range(len(blocks))]


# --- captures ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("device", DEVICES)
def test_captures_equal_plain_hooks(model_dirs, device, family, dtype):
    model = load(model_dirs, family, device, dtype)
    ids = token_ids(model, device=device, length=9)
    want = plain_resid_post(model, ids)
    got = hs.collect(model, ids, "blocks.*.resid_post")
    assert len(got) == len(want)
    for layer, ref in enumerate(want):
        act = got[f"blocks.{layer}.resid_post"]
        assert act.device.type == device and act.dtype == dtype
        assert torch.equal(act, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_copies_to_host_equal_the_device_values(model_dirs, device):
    """`device="cpu"` from a CUDA model goes through a pinned buffer and a non-blocking copy; the
    values read afterwards must be the synchronised ones."""
    model = load(model_dirs, "gpt2", device)
    ids = token_ids(model, 4, 32, device=device)
    want = plain_resid_post(model, ids)
    got = hs.collect(
        model,
        ids,
        ["blocks.0.resid_post", "blocks.2.resid_post"],
        device="cpu",
        dtype=torch.bfloat16,
        positions=slice(1, None),
    )
    for layer in (0, 2):
        act = got[f"blocks.{layer}.resid_post"]
        assert act.device.type == "cpu"
        assert torch.equal(act, want[layer][:, 1:].to(torch.bfloat16).cpu())
        if device == "cuda":
            assert act.is_pinned()  # the copy really took the pinned, non-blocking path


# --- gradients and edits ----------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_grads_equal_autograd(model_dirs, device):
    model = load(model_dirs, "llama", device)
    ids = token_ids(model, device=device, length=9)
    kept: list[Tensor] = []
    block = blocks_of(model)[1]

    def keep(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        kept.append(out)

    handle = block.register_forward_hook(keep)
    try:
        logits = model(ids, use_cache=False).logits
    finally:
        handle.remove()
    want = torch.autograd.grad(logits.float().pow(2).mean(), kept[0])[0]
    got = hs.grads(model, ids, "blocks.1.resid_post", lambda out: out.logits.float().pow(2).mean())
    assert torch.equal(got["blocks.1.resid_post"], want)


@pytest.mark.parametrize("device", DEVICES)
def test_steer_and_ablate_equal_hand_written_hooks(model_dirs, device):
    model = load(model_dirs, "gpt2", device)
    ids = token_ids(model, device=device, length=9)
    vector = torch.randn(model.config.n_embd, generator=torch.Generator().manual_seed(1)).to(device)
    blocks = blocks_of(model)

    def add(module, args, output):
        return (output[0] + 2.0 * vector, *output[1:]) if isinstance(output, tuple) else output + 2.0 * vector

    def zero_head0(module, args, kwargs):  # attn.z enters c_proj as [batch, pos, heads * d_head]
        z = args[0].clone()
        z[..., : model.config.n_embd // model.config.n_head] = 0
        return (z,), kwargs

    handles = [
        blocks[1].register_forward_hook(add),
        blocks[0].attn.c_proj.register_forward_pre_hook(zero_head0, with_kwargs=True),
    ]
    try:
        with torch.inference_mode():
            want = model(ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    before = hook_count(model)
    with (
        hs.edit(
            model, hs.steer("blocks.1.resid_post", vector, scale=2.0), hs.ablate("blocks.0.attn.z", heads=[0])
        ),
        torch.inference_mode(),
    ):
        got = model(ids, use_cache=False).logits
    assert hook_count(model) == before
    assert torch.equal(got, want)


# --- extraction -------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_extract_round_trip_equals_plain_hooks(model_dirs, device, tmp_path):
    from hookscope.extract import ExtractConfig, extract
    from hookscope.sources import batches, iter_documents, pack

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "\n\n".join(f"Document {i} talks about hooks, layers and the residual stream." for i in range(40))
    )
    cfg = ExtractConfig(
        out=str(tmp_path / "store"),
        model=str(model_dirs["gpt2"]),
        points=["blocks.1.resid_post"],
        data=str(corpus),
        context=16,
        batch_size=4,
        dtype="float32",
        device=device,
        progress=False,
        shard_rows=100,
    )
    summary = extract(cfg)
    store = hs.open_store(cfg.out, verify=True)
    assert len(store) == summary.rows > 0
    # the reference: the same packed batches through a plain hook on the same device
    loaded = hs.load(cfg.model, device=device)
    rows, kept = [], []
    sequences = pack(iter_documents(cfg.data), loaded.tokenizer, context=cfg.context)
    for batch in batches(sequences, cfg.batch_size):
        keep = batch["attention_mask"].bool() & ~batch["special_mask"].bool()
        kept.clear()
        handle = blocks_of(loaded.model)[1].register_forward_hook(
            lambda m, a, out: kept.append(out[0] if isinstance(out, tuple) else out)
        )
        try:
            with torch.inference_mode():
                loaded.model(
                    input_ids=batch["input_ids"].to(device),
                    attention_mask=batch["attention_mask"].to(device),
                    use_cache=False,
                )
        finally:
            handle.remove()
        rows.append(kept[0][keep.to(device)].cpu())
    assert torch.equal(store.tensor("blocks.1.resid_post"), torch.cat(rows))


@cuda_only
def test_a_ring_pinned_by_registering_memory_gives_the_same_store(model_dirs, tmp_path, monkeypatch):
    """On CUDA the run has PyTorch's pinned allocator register ordinary memory (loading/allocator.py):
    the setting is on while the run pins its ring, the settings are as they were after, and the
    shards are byte for byte those of a run that pinned with cudaHostAlloc."""
    from hookscope.extract import ExtractConfig, extract
    from hookscope.loading import allocator

    if not hasattr(torch._C, "_accelerator_getAllocatorSettings"):
        pytest.skip("this torch cannot read its allocator settings back: pinned as before")

    def settings() -> dict[str, str]:
        text = torch._C._accelerator_getAllocatorSettings()
        return dict(item.split(":", 1) for item in text.split(",") if item)

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Document {i} is about pinned buffers and pages." for i in range(60)))
    before = settings()
    real, seen = torch._C._accelerator_setAllocatorSettings, []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda s: (seen.append(s), real(s)))
    stores = {}
    for register in ("1", "0"):
        monkeypatch.setenv(allocator.REGISTER_ENV, register)
        cfg = ExtractConfig(
            out=str(tmp_path / f"store-{register}"),
            model=str(model_dirs["gpt2"]),
            points=["blocks.1.resid_post", "blocks.2.resid_post"],
            data=str(corpus),
            context=16,
            batch_size=4,
            dtype="bfloat16",
            device="cuda",
            progress=False,
            shard_rows=100,
        )
        extract(cfg)
        shards = sorted(Path(cfg.out, "shards").glob("*.safetensors"))
        stores[register] = {p.name: p.read_bytes() for p in shards}
    assert len(seen) == 2 and "pinned_use_cuda_host_register:True" in seen[0]  # on and off, first run
    restored = {**before, "pinned_use_cuda_host_register": "False"}
    restored.setdefault("pinned_num_register_threads", "1")
    assert settings() == restored
    assert stores["1"] == stores["0"] and len(stores["1"]) > 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_stacked_extraction_holds_the_unstacked_rows(model_dirs, device, tmp_path):
    """`--stack` on the device (the points stacked there, then one copy-out) against the same run
    unstacked, block by block."""
    from hookscope.extract import ExtractConfig, extract

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "\n\n".join(f"Document {i} talks about hooks, layers and the residual stream." for i in range(40))
    )
    stores = {}
    for stack in (True, False):
        out = tmp_path / f"store-{stack}"
        extract(
            ExtractConfig(
                out=str(out),
                model=str(model_dirs["llama"]),
                points=["blocks.*.resid_post"],
                data=str(corpus),
                context=16,
                batch_size=4,
                dtype="bfloat16",
                device=device,
                progress=False,
                shard_rows=100,
                stack=stack,
            )
        )
        stores[stack] = hs.open_store(out, verify=True)
    column = stores[True].tensor("blocks.*.resid_post")
    assert column.shape[1] == SIZE["n_layers"] and len(column) == len(stores[False]) > 0
    for layer in range(SIZE["n_layers"]):
        assert torch.equal(column[:, layer], stores[False].tensor(f"blocks.{layer}.resid_post"))


# --- compile, CUDA graphs, device maps, the profiler: CUDA only (the CPU paths have their own tests) --


@cuda_only
@pytest.mark.parametrize("policy", ["blocks", "full"])
def test_compiled_captures_equal_eager_on_cuda(model_dirs, policy):
    eager = load(model_dirs, "gpt2", "cuda")
    ids = token_ids(eager, device="cuda", length=9)
    want = hs.collect(eager, ids, "blocks.*.resid_post", stop=False)
    compiled = hs.load(str(model_dirs["gpt2"]), device="cuda", compile_policy=policy).model
    for _ in range(2):  # the second call runs the cached graph
        got = hs.collect(compiled, ids, "blocks.*.resid_post", stop=False)
        for name, ref in want.items():
            # inductor fuses differently from eager: float32 rounding, nothing more
            torch.testing.assert_close(got[name], ref, rtol=1e-4, atol=1e-5)


@cuda_only
def test_reduce_overhead_captures_survive_the_next_replay(model_dirs):
    """Under CUDA graphs the compiled outputs live in a pool the next replay overwrites: a capture
    must be a copy that keeps its values."""
    from hookscope import compiling as policy

    model = load(model_dirs, "gpt2", "cuda")
    ids_a = token_ids(model, device="cuda", length=9)
    ids_b = ids_a.flip(0)
    want_a = plain_resid_post(model, ids_a)[-1]
    policy.compile_model(model, "full", mode="reduce-overhead")
    for _ in range(3):  # warm up and record the graph
        hs.collect(model, ids_a, "blocks.2.resid_post", stop=False)
    first = hs.collect(model, ids_a, "blocks.2.resid_post", stop=False)["blocks.2.resid_post"]
    hs.collect(model, ids_b, "blocks.2.resid_post", stop=False)  # a replay that would overwrite it
    torch.testing.assert_close(first, want_a, rtol=1e-4, atol=1e-5)


@cuda_only
def test_device_map_auto_captures_equal_plain_hooks(model_dirs):
    model = hs.load(str(model_dirs["llama"]), device_map="auto").model
    ids = token_ids(model, length=9, device=str(model.get_input_embeddings().weight.device))
    want = plain_resid_post(model, ids)
    got = hs.collect(model, ids, "blocks.*.resid_post")
    for layer, ref in enumerate(want):
        assert torch.equal(got[f"blocks.{layer}.resid_post"], ref)


@cuda_only
def test_profile_has_cuda_rows_and_a_memory_snapshot(model_dirs, tmp_path):
    model = load(model_dirs, "gpt2", "cuda")
    ids = token_ids(model, 4, 32, device="cuda")
    report = hs.profile(model, ids, steps=3, warmup=1, out_dir=tmp_path)
    blocks = report.block_rows()
    assert len(blocks) == 3
    assert all(row.device_s and row.device_s > 0 for row in blocks), report.summary()
    assert report.memory_snapshot, "a CUDA profile records a memory snapshot"
    assert (tmp_path / "trace.json").stat().st_size > 0


# --- points= loads (issue 29) -----------------------------------------------------------------


def _needed_llama(full: nn.Module, through: int) -> set[str]:
    """The embeddings and blocks 0..through, by name (written from the module tree)."""
    blocks = tuple(f"model.layers.{i}." for i in range(through + 1))
    return {"model.embed_tokens.weight"} | {n for n, _ in full.named_parameters() if n.startswith(blocks)}


@pytest.mark.parametrize("placement", ["device", "device_map"])
@pytest.mark.parametrize("device", DEVICES)
def test_points_load_places_only_the_needed_weights(model_dirs, device, placement):
    full = load(model_dirs, "llama", device)
    where = {"device": device} if placement == "device" else {"device_map": {"": device}}
    if device == "cuda":
        # the last test's models are garbage in a reference cycle (transformers' loader leaves frames
        # that hold the loading function's locals): freed by the collector at any moment, they would
        # offset what this load allocates (seen on the H200: grown 0 for 605,504 bytes placed)
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
    part = hs.load(str(model_dirs["llama"]), points=["blocks.1.resid_post"], **where).model
    on_device = {n for n, p in part.named_parameters() if p.device.type == torch.device(device).type}
    assert on_device == _needed_llama(full, through=1)
    if device == "cuda":  # the device holds the needed weights and buffers, not the model's
        tensors = [t for t in (*part.parameters(), *part.buffers()) if not t.is_meta]
        needed = sum(t.numel() * t.element_size() for t in tensors)
        grown = torch.cuda.memory_allocated() - before
        assert needed <= grown <= needed + 512 * len(tensors)  # the allocator rounds each up to 512 B
    ids = token_ids(full, device=device)
    want = plain_resid_post(full, ids)[1]
    assert torch.equal(hs.collect(part, ids, "blocks.1.resid_post")["blocks.1.resid_post"], want)


@cuda_only
def test_points_load_with_device_map_auto_spreads_the_needed_blocks(model_dirs):
    full = hs.load(str(model_dirs["llama"]), device_map="auto").model
    part = hs.load(str(model_dirs["llama"]), device_map="auto", points=["blocks.1.resid_post"]).model
    assert {n for n, p in part.named_parameters() if not p.is_meta} == _needed_llama(full, through=1)
    assert all(p.device.type == "cuda" for p in part.parameters() if not p.is_meta)
    ids = token_ids(full, device=str(full.get_input_embeddings().weight.device))
    want = plain_resid_post(full, ids)[1]
    assert torch.equal(hs.collect(part, ids, "blocks.1.resid_post")["blocks.1.resid_post"], want)


@pytest.mark.parametrize("device", DEVICES)
def test_points_load_through_the_last_block_with_a_needed_block_offloaded(model_dirs, device):
    """accelerate's dispatch as `device_map` makes it when a GPU is short: block 2 offloaded to the
    CPU (its weights on meta between passes, brought to the main device for each), the other needed
    modules on the main device. On "cpu" the main device is spelt torch.device("cpu"), which
    accelerate tells apart from the offload target "cpu": the same hooks, on one machine."""
    main = torch.device("cpu") if device == "cpu" else torch.device("cuda", 0)
    device_map = {
        "model.embed_tokens": main,
        "model.rotary_emb": main,
        "model.layers.0": main,
        "model.layers.1": main,
        "model.layers.2": "cpu",
        "model.norm": main,
        "lm_head": main,
    }
    full = load(model_dirs, "llama", device)
    part = hs.load(str(model_dirs["llama"]), device_map=device_map, points=["blocks.2.resid_post"]).model
    assert {n for n, p in part.named_parameters() if p.device == main} == _needed_llama(full, through=1)
    on_main = ("model.embed", "model.layers.0.", "model.layers.1.")
    assert all(p.is_meta for n, p in part.named_parameters() if not n.startswith(on_main))
    ids = token_ids(full, device=device)
    got = hs.collect(part, ids, ["blocks.1.resid_post", "blocks.2.resid_post"])
    want = plain_resid_post(full, ids)
    assert torch.equal(got["blocks.1.resid_post"], want[1])
    assert torch.equal(got["blocks.2.resid_post"], want[2])
    # the offloaded block ran; the final norm, never loaded, is what a pass must not reach
    with pytest.raises(PointNotLoadedError, match="reached model.norm"):
        with hs.capture(part, "blocks.2.resid_post"):
            part(ids)


@pytest.mark.parametrize("device", DEVICES)
def test_a_streamed_extraction_equals_the_in_memory_one(model_dirs, device, tmp_path):
    """--max-memory on the device: the same batch shapes run the same kernels, so the rows are
    compared exactly (the in-memory extraction on the same device is the reference)."""
    from hookscope.extract import ExtractConfig, extract
    from hookscope.store import open_store

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "\n\n".join(f"Document {i}: the residual stream, layer by layer, block by block." for i in range(40))
    )
    stores = {}
    for mode, limit in (("memory", None), ("streamed", "1MB")):
        extract(
            ExtractConfig(
                out=str(tmp_path / mode),
                model=str(model_dirs["llama"]),
                data=str(corpus),
                points=["blocks.1.resid_post", "blocks.0.attn.z"],
                context=32,
                batch_size=4,
                dtype="float32",
                device=device,
                progress=False,
                max_memory=limit,
            )
        )
        stores[mode] = open_store(tmp_path / mode)
    for name in ("blocks.1.resid_post", "blocks.0.attn.z", "token_ids"):
        assert torch.equal(stores["streamed"].tensor(name), stores["memory"].tensor(name))
    assert len(stores["memory"]) > 200


@pytest.mark.parametrize("device", DEVICES)
def test_streamed_blocks_run_on_buffers_allocated_once(model_dirs, device):
    """--max-memory's reused buffers on the device: each block's parameters, as its forward sees
    them, lie in the one set of device buffers (on CUDA; the host slots on the CPU), the host slots
    are pinned on CUDA, and the values are the block's tensors of the checkpoint file."""
    from safetensors.torch import load_file

    from hookscope.loading import streamer_for
    from hookscope.loading.block_buffers import data_ranges

    stored = load_file(model_dirs["llama"] / "model.safetensors")
    loaded = hs.load(str(model_dirs["llama"]), device="meta")
    streamer = streamer_for(
        loaded, ["blocks.2.resid_post"], 10**8, batch_size=2, context=16, dtype=torch.float32, device=device
    )
    ranges = data_ranges(streamer.buffers)
    where = ranges[-1:] if device == "cuda" else ranges  # the device set is listed last
    assert all(whole.is_pinned() == (device == "cuda") for whole, _ in streamer.buffers.host)
    seen = []
    layers = loaded.model.model.layers
    hooks = [
        layers[k].register_forward_pre_hook(
            lambda module, args, k=k: seen.append(
                (
                    k,
                    {
                        n: (p.data_ptr(), p.device.type, p.detach().clone())
                        for n, p in module.named_parameters()
                    },
                )
            )
        )
        for k in range(len(layers))
    ]
    ids = token_ids(loaded.model, batch=2, length=16, device=device)
    try:
        for _ in range(2):
            streamer.run_chunk([{"input_ids": ids, "attention_mask": torch.ones_like(ids)}], [None])
    finally:
        for hook in hooks:
            hook.remove()
        streamer.close()
    assert [k for k, _ in seen] == [0, 1, 2] * 2
    for k, params in seen:
        for name, (address, kind, value) in params.items():
            assert kind == device and any(lo <= address < hi for lo, hi in where)
            assert torch.equal(value.cpu(), stored[f"model.layers.{k}.{name}"])


def float64_stats(rows: Tensor) -> tuple[int, int, float, float, Tensor, Tensor]:
    """The reference statistics, in float64 from the rows on the CPU: non-finite values, then over
    the rows with no non-finite value their count, sum and sum of squares of L2 norms, and the
    per-dimension mean and sum of squared deviations."""
    flat = rows.detach().cpu().double().reshape(rows.shape[0], -1)
    whole = torch.isfinite(flat).all(dim=1)
    kept = flat[whole]
    norms = kept.norm(dim=1)
    mean = kept.mean(0) if len(kept) else torch.zeros(flat.shape[1], dtype=torch.float64)
    return (
        int((~torch.isfinite(flat)).sum()),
        len(kept),
        float(norms.sum()),
        float((norms**2).sum()),
        mean,
        ((kept - mean) ** 2).sum(0),
    )


def assert_stats_equal_float64(got, rows: Tensor) -> None:
    nonfinite, count, norm_sum, norm_sumsq, mean, m2 = float64_stats(rows)
    assert (got.nonfinite, got.norm_count) == (nonfinite, count)
    assert got.norm_sum == pytest.approx(norm_sum, rel=1e-5)
    assert got.norm_sumsq == pytest.approx(norm_sumsq, rel=1e-5)
    assert got.mean.device.type == "cpu" and got.m2.device.type == "cpu"
    torch.testing.assert_close(got.mean, mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.m2, m2, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_statistics_where_the_activations_are_and_the_copy_out(device):
    """The extraction's `out` stage: on a device, statistics taken there and the values copied into a
    reused page-locked buffer on a side stream, with no host sync; once the handoff is waited on,
    the host copy equals the device values bit for bit and the statistics equal a float64
    recomputation (sums to float tolerance: another reduction order). On the CPU the rows go as
    they are and the writer measures them."""
    from hookscope.extract.copyout import CopyOut

    g = torch.Generator().manual_seed(0)
    copy_out = CopyOut()
    buffers = set()
    for step in range(4):
        acts = {
            "a": (torch.randn(300 + step, 64, generator=g) * 2 + 5).to(device, torch.bfloat16),
            "b": torch.randn(300 + step, 4, 16, generator=g).to(device),
        }
        acts["b"][7, 1, 3] = float("nan")
        acts["b"][11, 0, 0] = float("inf")
        with _NoSync(device):
            host, handoff = copy_out(acts)
        if device == "cpu":
            assert handoff is None
            for name, value in acts.items():
                assert host[name] is value
            continue
        stats = handoff.wait()
        for name, value in acts.items():
            assert host[name].device.type == "cpu" and host[name].is_pinned()
            torch.testing.assert_close(host[name], value.cpu(), rtol=0, atol=0, equal_nan=True)
            assert_stats_equal_float64(stats[name], value)
        buffers.add(handoff.buffer.data_ptr())
        handoff.release()
    if device == "cuda":  # each batch reused the buffer the last one handed back: memory stays flat
        # (one more may have been made ahead in the background, after the first: ring.py's spare)
        ring = copy_out.ring
        assert len(buffers) == 1 and ring.made - ring.made_ahead == 1 and ring.made_ahead <= 1


@pytest.mark.parametrize("device", DEVICES)
def test_stats_tensors_equal_a_float64_recomputation(device):
    """`stats_tensors`: the statistics with no branch on a value (so no host sync), non-finite rows
    and an all-non-finite batch included."""
    from hookscope.store.stats import PointStats, stats_tensors

    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        rows = (torch.randn(700, 48, generator=g) * 3 + 100).to(device, dtype)
        rows[5, 3], rows[600, 1] = float("nan"), float("-inf")
        before = rows.clone()
        with _NoSync(device):
            parts = stats_tensors(rows)
        assert torch.equal(rows.nan_to_num(), before.nan_to_num())  # the caller's rows are untouched
        assert_stats_equal_float64(PointStats.of_tensors(*(p.cpu() for p in parts)), rows)
    empty = PointStats.of_tensors(
        *(p.cpu() for p in stats_tensors(torch.full((5, 4), float("nan"), device=device)))
    )
    assert (empty.nonfinite, empty.norm_count, empty.norm_sum) == (20, 0, 0.0)
    assert torch.equal(empty.mean, torch.zeros(4, dtype=torch.float64)) and torch.equal(empty.m2, empty.mean)


# --- the extraction pipeline: nothing in the forward or the out stage waits for the device ------


class _NoSync:
    """On CUDA, any operation that makes the host wait for the device raises inside the block."""

    def __init__(self, device: str):
        self.device = device

    def __enter__(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc) -> None:
        if self.device == "cuda":
            torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_host_token_mask_gathers_rows_without_waiting_for_the_device(model_dirs, device):
    """The extraction's token mask stays on the CPU (its data stage made it there): the kept rows
    are found there and sent to the device without a host sync (finding them on the device waits
    for it), and the rows equal a plain hook's activation under the same mask."""
    from hookscope.token_rows import KeptRows, select_tokens

    g = torch.Generator().manual_seed(3)
    mask = torch.rand(3, 11, generator=g) > 0.4
    x = torch.randn(3, 11, 16, generator=g).to(device)
    with _NoSync(device):
        got = select_tokens(x, mask, 1, KeptRows())
        cast = select_tokens(x, mask, 1, KeptRows(), cast=torch.bfloat16)
    assert torch.equal(got, x[mask.to(device)])
    assert torch.equal(cast.to(torch.bfloat16), x[mask.to(device)].to(torch.bfloat16))

    model = load(model_dirs, "gpt2", device)
    ids = token_ids(model, batch=3, length=11, device=device)
    want = plain_resid_post(model, ids)[1][mask.to(device)]
    got = hs.collect(model, ids, "blocks.1.resid_post", token_mask=mask)["blocks.1.resid_post"]
    assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_extraction_model_stage_never_waits_for_the_device(model_dirs, device, family, tmp_path):
    """The main thread's whole share of an extraction, as the loop runs it: the executor's forward
    with its capture of several points (`InMemory.forward`), the non-finite check and
    the out stage (`_checked`: statistics on the device, the copy to the host on a side stream),
    each batch made ready by the data stage (`Source.prepare`: pinned inputs, the keep mask and the
    unpadded flag on the CPU). On CUDA nothing in it may wait for the device (transformers' check
    of the attention mask did, once per batch); the rows then equal a plain hook's on the same
    device, the model called with its attention mask."""
    from hookscope.extract import ExtractConfig
    from hookscope.extract.copyout import CopyOut
    from hookscope.extract.loop import _checked, _start, _timed
    from hookscope.extract.stages import Stages
    from hookscope.sources import source_for

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "\n\n".join(f"Document {i} talks about hooks, layers and the residual stream." for i in range(40))
    )
    points = ["blocks.0.resid_post", "blocks.1.resid_post", "blocks.2.resid_post"]
    cfg = ExtractConfig(
        out=str(tmp_path / "store"),
        model=str(model_dirs[family]),
        points=points,
        data=str(corpus),
        context=16,
        batch_size=4,
        dtype="float32",
        device=device,
        progress=False,
        max_tokens=16 * 4 * 4,
    )
    source, executor, _ = _start(cfg, source_for(cfg))
    prepared = [(i, source.prepare(b, device)) for i, b in enumerate(source.batches())]
    assert len(prepared) == 4 and all(b.call.unpadded for _, b in prepared)
    stages = Stages()
    ran = _timed(_checked(executor.run(iter(prepared)), "warn", stages, CopyOut(), {}), stages)
    with _NoSync(device):
        done = list(ran)
    loaded = hs.load(cfg.model, device=device)
    blocks = blocks_of(loaded.model)
    for (index, _, (host, _), handoff), (_, want_batch) in zip(done, prepared, strict=True):
        if handoff is not None:
            handoff.wait()
        keep = want_batch["attention_mask"].bool() & ~want_batch["special_mask"].bool()
        want = plain_hooks(
            loaded.model,
            {i: (blocks[i], "output", first) for i in range(3)},
            lambda b=want_batch: loaded.model(
                input_ids=b["input_ids"].to(device),
                attention_mask=b["attention_mask"].to(device),
                use_cache=False,
            ),
        )
        for i, point in enumerate(points):
            assert torch.equal(host[point], want[i][keep.to(device)].cpu()), (index, point)
        if handoff is not None:
            handoff.release()
