"""Block streaming into reused buffers (block_buffers.py): every block's weights are read into one
of two buffer sets allocated once (the process's memory does not grow with the blocks: that is
measured by bench/bench_stream_memory.py, not timed here), with the values the checkpoint holds,
converted as the in-memory load converts them; blocks that differ fall back to the ordinary load."""

from __future__ import annotations

import json
import platform
import re
import shutil
from pathlib import Path

import pytest
import torch
from faultkit import compare_stores, extract_config, write_corpus
from forkserver import ForkServer
from safetensors.torch import load_file

import hookscope as hs
from hookscope.extract import ExtractConfig, extract
from hookscope.loading import parse_size, streamer_for
from hookscope.loading.block_buffers import data_ranges
from hookscope.loading.embedding_rows import embedding_rows_for
from hookscope.loading.safetensors_reads import safetensors_index
from hookscope.testing import save_tiny

SAME = {"rows_lost": 0, "rows_duplicated": 0, "same_values": True, "same_files": True}


def _converting_copy(model_dir: Path, to: Path) -> Path:
    """The same float32 weights, with a config that asks for bfloat16: every block is converted."""
    shutil.copytree(model_dir, to)
    config = json.loads((to / "config.json").read_text())
    (to / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    return to


def _params_seen_in_each_block(model_dir: Path, point: str, chunks: int, limit: str, **load):
    """Run `chunks` chunks of one batch through a streamer; per real block call (a pre-hook on the
    module path written here): the block index and, per parameter as the forward sees it, its
    address and a copy of its values (the buffers are overwritten by later blocks)."""
    loaded = hs.load(str(model_dir), device="meta", **load)
    streamer = streamer_for(loaded, [point], parse_size(limit), batch_size=2, context=16, dtype=torch.float32)
    seen: list[tuple[int, dict[str, tuple[int, torch.Tensor]]]] = []
    layers = loaded.model.model.layers
    hooks = [
        layers[k].register_forward_pre_hook(
            lambda module, args, k=k: seen.append(
                (k, {name: (p.data_ptr(), p.detach().clone()) for name, p in module.named_parameters()})
            )
        )
        for k in range(len(layers))
    ]
    ids = torch.randint(3, 100, (2, 16))
    try:
        for _ in range(chunks):
            streamer.run_chunk([{"input_ids": ids, "attention_mask": torch.ones_like(ids)}], [None])
    finally:
        for hook in hooks:
            hook.remove()
        streamer.close()
    return streamer, seen


@pytest.mark.parametrize("convert", [False, True], ids=["float32", "float32 computed in bfloat16"])
def test_every_block_runs_on_the_buffers_allocated_once_holding_its_own_weights(tiny_dirs, tmp_path, convert):
    """Three blocks, three chunks: each block's parameters, as its forward sees them, lie inside the
    buffer sets allocated when the streamer started (a fresh tensor per block would lie elsewhere),
    and hold that block's tensors of the checkpoint file (read with safetensors' own loader, converted
    by `Tensor.to`: a read ahead into the wrong slot, or a stale slot, would show). A block stored in
    the compute dtype is read ahead into the page cache and copied into one set; a converted one is
    read ahead into a second set, and both sets are used."""
    model_dir = _converting_copy(tiny_dirs["llama"], tmp_path / "bf16") if convert else tiny_dirs["llama"]
    stored = load_file(model_dir / "model.safetensors")
    streamer, seen = _params_seen_in_each_block(model_dir, "blocks.2.resid_post", 3, "700KB")
    assert streamer.plan.read_ahead  # two blocks fit: the next one is read ahead either way
    ranges = data_ranges(streamer.buffers)
    sets = 2 if convert else 1
    assert [k for k, _ in seen] == [0, 1, 2] * 3 and len(ranges) == sets
    slots_used = set()
    for k, params in seen:
        for name, (address, param) in params.items():
            slot = next(i for i, (lo, hi) in enumerate(ranges) if lo <= address < hi)
            assert address + param.numel() * param.element_size() <= ranges[slot][1]
            slots_used.add(slot)
            want = stored[f"model.layers.{k}.{name}"].to(param.dtype)
            assert torch.equal(param.view(torch.uint8), want.view(torch.uint8))
    assert slots_used == set(range(sets))


def test_a_float32_checkpoint_computed_in_bfloat16_is_converted_into_the_buffers(tiny_dirs, tmp_path):
    """The buffers are bfloat16 and each block's weights in them are the file's float32 tensors
    rounded as `Tensor.to` rounds (to nearest even; truncating would differ in the last bit)."""
    model_dir = _converting_copy(tiny_dirs["llama"], tmp_path / "bf16")
    stored = load_file(model_dir / "model.safetensors")
    assert stored["model.layers.0.mlp.up_proj.weight"].dtype == torch.float32
    streamer, seen = _params_seen_in_each_block(model_dir, "blocks.2.resid_post", 2, "700KB")
    assert streamer.buffers is not None
    for k, params in seen:
        for name, (_, param) in params.items():
            want = stored[f"model.layers.{k}.{name}"].to(torch.bfloat16)
            assert param.dtype == torch.bfloat16
            assert torch.equal(param.view(torch.int16), want.view(torch.int16))


def test_converted_blocks_and_embeddings_hold_what_from_pretrained_gives(tiny_dirs, tmp_path):
    """A float32 checkpoint whose config asks bfloat16: every streamed block's parameters, and the
    embedding rows looked up from the file (every row, in a shuffled order, some twice), are bit for
    bit what a plain `from_pretrained(dtype=torch.bfloat16)` of the same directory holds (an
    independent load: transformers' own, no hookscope)."""
    from transformers import AutoModelForCausalLM

    model_dir = _converting_copy(tiny_dirs["llama"], tmp_path / "bf16")
    plain = dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).named_parameters())
    streamer, seen = _params_seen_in_each_block(model_dir, "blocks.2.resid_post", 1, "700KB")
    assert [k for k, _ in seen] == [0, 1, 2]
    for k, params in seen:
        for name, (_, param) in params.items():
            want = plain[f"model.layers.{k}.{name}"]
            assert param.dtype == want.dtype == torch.bfloat16
            assert torch.equal(param.view(torch.int16), want.view(torch.int16)), (k, name)
    # the table is not resident: its rows are read as looked up, and are the converted table's
    embed = streamer.model.get_submodule("model.embed_tokens")
    assert embed.weight.is_meta
    table = plain["model.embed_tokens.weight"]
    ids = torch.cat([torch.randperm(table.shape[0]), torch.tensor([5, 5, 0, table.shape[0] - 1, 7, 6, 9])])
    ids = ids[: len(ids) // 2 * 2]  # two rows in the (2, -1) case
    for shape in [(-1,), (2, -1)]:
        got, want = embed(ids.view(shape)), torch.nn.functional.embedding(ids.view(shape), table)
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    with pytest.raises(IndexError):
        embed(torch.tensor([table.shape[0]]))
    # a GPU run keeps the table in device memory: a lookup there must not wait on host reads
    stored = safetensors_index(str(model_dir / "model.safetensors"))
    fresh = hs.load(str(model_dir), device="meta").model
    assert embedding_rows_for(fresh, stored.get, "cpu") is not None
    assert embedding_rows_for(fresh, stored.get, "cuda") is None


def _anon() -> int:
    """The process's resident anonymous memory (RssAnon), in bytes."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"^RssAnon:\s+(\d+)", status, re.M).group(1)) * 1024


def kept_after_free_probe(model_dir: str, mode: str) -> float:
    """Run in a fork-server child: MiB still held after 8 tensors of 2 MiB are made and freed (a
    small one made after them), inside a streamed block's forward or, with mode "plain", in a
    process that neither loads on `meta` nor streams."""
    kept: list[float] = []

    def kept_after_free(module=None, args=None) -> None:
        before = _anon()
        made = [torch.ones(2 * 2**20, dtype=torch.uint8) for _ in range(8)]
        later = torch.ones(16, dtype=torch.uint8)
        del made
        kept.append((_anon() - before) / 2**20)
        del later

    big = torch.ones(16 * 2**20, dtype=torch.uint8)  # freed: glibc's sliding threshold rises to 16 MiB
    del big
    if mode == "streaming":
        loaded = hs.load(model_dir, device="meta")
        streamer = streamer_for(
            loaded,
            ["blocks.1.resid_post"],
            parse_size("700KB"),
            batch_size=2,
            context=16,
            dtype=torch.float32,
        )
        loaded.model.model.layers[1].register_forward_pre_hook(kept_after_free)
        ids = torch.randint(3, 100, (2, 16))
        streamer.run_chunk([{"input_ids": ids, "attention_mask": torch.ones_like(ids)}], [None])
        streamer.close()
    else:
        kept_after_free()
    return kept[-1]


@pytest.fixture(scope="module")
def fresh_server():
    """A fork server of this module's own: its children start from a process that has imported
    torch, hookscope and Llama's model code and done nothing else, as a fresh Python would (the
    shared server's heap holds what other tests warmed it with, a load among them), without a Python
    start-up per probe nor an import of the model code in each."""
    server = ForkServer()
    server.warm("importlib:import_module", name="transformers.models.llama.modeling_llama")
    yield server
    server.close()


@pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or not Path("/proc/self/status").exists(),
    reason="glibc's allocator and Linux's /proc",
)
@pytest.mark.slow
def test_inside_a_streamed_block_freed_tensors_go_back_to_the_system(tiny_dirs, fresh_server):
    """In a fresh process whose heap would keep them (glibc's threshold slid up by a freed 16 MiB
    tensor), 16 MiB of tensors made and freed inside a streamed block's forward leave the resident
    anonymous memory as it was; the same in a process that neither loads on `meta` nor streams stays
    resident (the premise). Rejects a meta load + streamer that leave glibc's sliding threshold
    (the heap then holds what a pass frees, as measured before). Each process is a child of a
    fork server that has done nothing but its imports."""

    def kept(mode: str) -> float:
        reply = fresh_server.call(
            "test_stream_buffers:kept_after_free_probe", model_dir=str(tiny_dirs["llama"]), mode=mode
        )
        assert reply.status == 0, reply.log[-2000:]
        return reply.result

    assert kept("plain") > 12
    assert kept("streaming") < 2


def test_a_converting_checkpoint_streams_the_in_memory_store_byte_for_byte(tiny_dirs, tmp_path):
    """The whole extraction of the float32 checkpoint computed in bfloat16: the store streamed
    through the buffers is the in-memory one's, byte for byte."""
    model_dir = _converting_copy(tiny_dirs["llama"], tmp_path / "bf16")
    points = ["blocks.2.resid_post", "blocks.0.attn.z"]
    diff = _streamed_against_in_memory(model_dir, points, "600KB", tmp_path)
    assert diff == {**diff, **SAME} and diff["rows"] > 500


@pytest.mark.parametrize("convert", [False, True], ids=["float32", "float32 computed in bfloat16"])
def test_blocks_that_differ_stream_without_buffers(tmp_path, convert):
    """RWKV's block 0 holds a norm the others lack: its blocks are loaded the ordinary way, one at
    a time (the next one's bytes paged in ahead, converted ones too: that read ahead used to fail
    on them), and the streamed store is still the in-memory one."""
    model_dir = save_tiny("rwkv", tmp_path / "rwkv", d_model=32, n_layers=3)
    if convert:
        model_dir = _converting_copy(model_dir, tmp_path / "rwkv-bf16")
    loaded = hs.load(str(model_dir), device="meta")
    blocks = [dict(loaded.model.get_submodule(path).named_parameters()) for path in loaded.arch.block_paths]
    assert set(blocks[0]) != set(blocks[1])  # the premise: the blocks differ
    streamer = streamer_for(
        loaded, ["blocks.2.resid_post"], 10**8, batch_size=2, context=16, dtype=torch.float32
    )
    assert streamer.buffers is None
    points = ["blocks.2.resid_post", "blocks.0.resid_post"]
    diff = _streamed_against_in_memory(model_dir, points, "1MB", tmp_path)
    assert diff == {**diff, **SAME} and diff["rows"] > 300


def _streamed_against_in_memory(model_dir: Path, points: list[str], limit: str, tmp_path: Path) -> dict:
    """compare_stores of 800 tokens extracted streamed under `limit` against in memory."""
    corpus = write_corpus(tmp_path / "corpus.txt", docs=20)
    for mode, max_memory in (("memory", None), ("streamed", limit)):
        extract(
            ExtractConfig(
                **extract_config(
                    model_dir, corpus, tmp_path / mode, points=points, max_tokens=800, max_memory=max_memory
                )
            )
        )
    return compare_stores(tmp_path / "streamed", tmp_path / "memory")


def held_probe(model_dir: str, blocks: int) -> tuple[bool, float]:
    """Run in a fork-server child: whether the streamer reads ahead with room for `blocks` blocks
    (and the weights outside the blocks and a chunk), and the most anonymous memory it holds inside
    a block's forward above the process after its `meta` load, in blocks."""
    loaded = hs.load(model_dir, device="meta")
    layers = loaded.model.model.layers
    block = sum(p.numel() * p.element_size() for p in layers[0].parameters())
    outside = sum(
        p.numel() * p.element_size() for n, p in loaded.model.named_parameters() if ".layers." not in n
    )
    before = _anon()
    limit = outside + blocks * block + 2**20
    streamer = streamer_for(
        loaded, ["blocks.3.resid_post"], limit, batch_size=2, context=16, dtype=torch.float32
    )
    inside = []
    for layer in layers:
        layer.register_forward_pre_hook(lambda module, args: inside.append(_anon()))
    ids = torch.randint(3, 100, (2, 16))
    for _ in range(2):
        streamer.run_chunk([{"input_ids": ids, "attention_mask": torch.ones_like(ids)}], [None])
    streamer.close()
    return streamer.plan.read_ahead, (max(inside) - before) / block


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory) -> dict[bool, Path]:
    """convert -> a 4-block Llama whose blocks are large beside the process's own noise (16 MiB in
    float32), saved once: in float32, and the same weights with a config asking bfloat16."""
    root = tmp_path_factory.mktemp("wide-llama")
    model_dir = save_tiny("llama", root / "llama", d_model=512, d_mlp=2048, n_layers=4, n_heads=8, context=64)
    return {False: model_dir, True: _converting_copy(model_dir, root / "bf16")}


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux's /proc")
@pytest.mark.parametrize("convert", [False, True], ids=["float32", "float32 computed in bfloat16"])
@pytest.mark.slow
def test_reading_ahead_holds_a_second_block_only_where_the_read_converts(wide_llama, fresh_server, convert):
    """Fresh processes (fork-server children): the anonymous memory (RssAnon, read from /proc) inside
    every streamed block's forward, above the process after its `meta` load, in blocks, with room
    for one block (no read-ahead) and for two (the next one read ahead). A float32 checkpoint
    computed in float32 holds the same either way (the next block waits in the page cache, copied
    in as it starts); a converted one holds one block more (converted in the spare slot while this
    one computes). Rejects a second slot where reading ahead is only a copy, and a read-ahead that
    holds nothing where it converts; the one-block run holding at least a block is the premise that
    RssAnon sees the weights."""

    def held(blocks: int) -> float:
        reply = fresh_server.call(
            "test_stream_buffers:held_probe", model_dir=str(wide_llama[convert]), blocks=blocks
        )
        assert reply.status == 0, reply.log[-2000:]
        read_ahead, held_blocks = reply.result
        assert read_ahead == (blocks == 2)
        return held_blocks

    one, two = held(1), held(2)
    assert 1 <= one < 1.9
    assert abs(two - one - (1 if convert else 0)) < 0.2, (one, two)
