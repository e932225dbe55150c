"""Block streaming (`--max-memory`): extraction layer-major over chunks of batches, a block's
weights in memory at a time. A streamed store must be the in-memory store byte for byte (on CPU
the batches have the same shapes), survive a SIGKILL at any moment, and keep no more weights
than the limit allows."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import torch
from faultkit import compare_stores, extract_config, shard_digests, write_corpus
from forkserver import ForkServer

import hookscope as hs
from hookscope.errors import HookscopeError
from hookscope.extract import ExtractConfig, extract
from hookscope.loading import parse_size, streamer_for
from hookscope.loading.block_buffers import BlockBuffers
from hookscope.loading.checkpoint import Checkpoint
from hookscope.store import open_store
from hookscope.testing import save_tiny

RUN = "kill_driver:run_extract"
POINTS = ["blocks.1.resid_post", "blocks.0.attn.z"]
# weights outside the blocks + two blocks + a few batches of hidden states, for the tiny models
LIMIT = "1MB"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("stream") / "corpus.txt", docs=40)


def _extract(model_dir: Path, corpus: Path, out: Path, **overrides) -> Path:
    extract(ExtractConfig(**extract_config(model_dir, corpus, out, **overrides)))
    return out


@pytest.mark.parametrize("family", ["gpt2", "llama", "neox_parallel", "bert"])
def test_a_streamed_store_is_the_in_memory_store_byte_for_byte(family, tiny_dirs, corpus, tmp_path):
    points = POINTS if family != "bert" else ["blocks.1.resid_post", "blocks.0.mlp.out"]
    want = _extract(tiny_dirs[family], corpus, tmp_path / "memory", points=points)
    got = _extract(tiny_dirs[family], corpus, tmp_path / "streamed", points=points, max_memory=LIMIT)
    diff = compare_stores(got, want)
    assert diff == {**diff, "rows_lost": 0, "rows_duplicated": 0, "same_values": True, "same_files": True}
    assert diff["rows"] > 1000


@pytest.mark.parametrize("family", ["mixtral", "mamba"])
def test_other_families_stream_too(family, corpus, tmp_path):
    """A mixture of experts (transformers fuses its experts while loading) and a state-space model."""
    model_dir = save_tiny(family, tmp_path / family, d_model=32, n_layers=3)
    points = ["blocks.1.resid_post", "blocks.0.resid_mid" if family == "mixtral" else "blocks.0.resid_post"]
    want = _extract(model_dir, corpus, tmp_path / "memory", points=points, max_tokens=600)
    got = _extract(
        model_dir, corpus, tmp_path / "streamed", points=points, max_tokens=600, max_memory="600KB"
    )
    assert shard_digests(got) == shard_digests(want)


def test_a_pickled_bin_checkpoint_streams_too(tiny_dirs, corpus, tmp_path):
    """Only `pytorch_model.bin` (torch.save's format): its blocks are read through torch.load's
    memory map, one at a time, and give the rows the safetensors checkpoint gives in memory (the
    files differ: a shard's metadata carries the settings hash, which covers the model)."""
    from safetensors.torch import load_file

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for file in tiny_dirs["llama"].iterdir():
        if file.suffix != ".safetensors":
            (pickled / file.name).write_bytes(file.read_bytes())
    torch.save(load_file(tiny_dirs["llama"] / "model.safetensors"), pickled / "pytorch_model.bin")
    want = _extract(tiny_dirs["llama"], corpus, tmp_path / "memory", points=POINTS, max_tokens=600)
    got = _extract(pickled, corpus, tmp_path / "streamed", points=POINTS, max_tokens=600, max_memory=LIMIT)
    diff = compare_stores(got, want)
    assert diff == {**diff, "rows_lost": 0, "rows_duplicated": 0, "same_values": True}
    assert diff["rows"] > 500


def test_the_last_block_and_after_it_equal_plain_hooks(tiny_dirs, corpus, tmp_path):
    """Points in the last block and after the blocks (the final norm) against forward hooks on the
    module paths, on the whole model loaded the ordinary way."""
    out = _extract(
        tiny_dirs["llama"],
        corpus,
        tmp_path / "s",
        points=["blocks.2.resid_post", "ln_final"],
        max_memory=LIMIT,
        dtype="float32",
        max_tokens=256,
        drop_bos=False,
    )
    store = open_store(out)
    model = hs.load(str(tiny_dirs["llama"])).model
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        model.get_submodule(path).register_forward_hook(
            lambda m, a, o, path=path: seen.__setitem__(path, o[0] if isinstance(o, tuple) else o)
        )
        for path in ("model.layers.2", "model.norm")
    ]
    ids = store.tensor("token_ids").reshape(-1, 32)  # every token kept: whole packed sequences
    want: dict[str, list[torch.Tensor]] = {"model.layers.2": [], "model.norm": []}
    with torch.inference_mode():
        for batch in ids.split(4):  # the extraction's batches: the same shapes, the same bits
            model(input_ids=batch, attention_mask=torch.ones_like(batch))
            for path, parts in want.items():
                parts.append(seen[path].reshape(-1, 64))
    for h in hooks:
        h.remove()
    assert torch.equal(store.tensor("blocks.2.resid_post"), torch.cat(want["model.layers.2"]))
    assert torch.equal(store.tensor("ln_final"), torch.cat(want["model.norm"]))


def test_resident_weights_stay_under_the_limit(tiny_dirs):
    """Parameters off meta, counted at every real block call by a pre-hook on its module path: the
    running block is whole, no other block is in memory, and the total is under the limit."""
    loaded = hs.load(str(tiny_dirs["llama"]), device="meta")
    limit = parse_size("700KB")
    streamer = streamer_for(
        loaded, ["blocks.2.resid_post"], limit, batch_size=2, context=16, dtype=torch.float32
    )
    model = loaded.model
    counts: list[tuple[int, int, int, int]] = []

    def count(k: int):
        def hook(module, args, kwargs):
            blocks = [
                sum(p.numel() for p in model.get_submodule(f"model.layers.{j}").parameters() if not p.is_meta)
                for j in range(3)
            ]
            total = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
            counts.append((k, blocks[k], sum(blocks) - blocks[k], total))

        return hook

    block_size = sum(p.numel() for p in model.get_submodule("model.layers.0").parameters())
    hooks = [
        model.get_submodule(f"model.layers.{k}").register_forward_pre_hook(count(k), with_kwargs=True)
        for k in range(3)
    ]
    ids = torch.randint(3, 100, (2, 16))
    try:
        for _ in range(2):  # two chunks
            streamer.run_chunk([{"input_ids": ids, "attention_mask": torch.ones_like(ids)}], [None])
    finally:
        for h in hooks:
            h.remove()
        streamer.close()
    assert [c[0] for c in counts] == [0, 1, 2, 0, 1, 2]  # each real block once per chunk, in order
    assert all(whole == block_size and others == 0 and total <= limit for _, whole, others, total in counts)
    assert 0 < streamer.peak_weight_bytes <= limit


def test_each_block_is_read_once_per_chunk_and_the_bar_shows_it(
    tiny_dirs, corpus, tmp_path, monkeypatch, capsys
):
    """Block 0's weights are read from the files (into a reused buffer, `BlockBuffers.read`, or by
    `Checkpoint.materialize` asked for transformer.h.0) once per chunk, each read followed by the
    chunk's batches through the block (counted by a pre-hook on its module path): no batch runs
    alone through a pass of its own (the check before the store opens is the first chunk). The
    progress bar names each block that runs, 1-based, in order."""
    reads: list[int] = []  # per read of block 0: the batches it then ran
    real_materialize, real_read, real_attach = Checkpoint.materialize, BlockBuffers.read, BlockBuffers.attach

    def count_passes(block) -> None:
        if not hasattr(block, "counted"):
            block.counted = block.register_forward_pre_hook(lambda *_: reads.__setitem__(-1, reads[-1] + 1))

    def materialize(self, model, wants, device_map):
        if wants("transformer.h.0.ln_1.weight"):
            reads.append(0)
            count_passes(model.get_submodule("transformer.h.0"))
        return real_materialize(self, model, wants, device_map)

    def read(self, slot, k):
        if k == 0:
            reads.append(0)
        return real_read(self, slot, k)

    def attach(self, k, module):
        if k == 0:
            count_passes(module)
        return real_attach(self, k, module)

    monkeypatch.setattr(Checkpoint, "materialize", materialize)
    monkeypatch.setattr(BlockBuffers, "read", read)
    monkeypatch.setattr(BlockBuffers, "attach", attach)
    out = _extract(tiny_dirs["gpt2"], corpus, tmp_path / "s", max_memory=LIMIT, progress=True)
    chunk = streamer_for(
        hs.load(str(tiny_dirs["gpt2"]), device="meta"),
        POINTS,
        parse_size(LIMIT),
        batch_size=4,
        context=32,
        dtype=torch.bfloat16,
    ).plan.chunk_batches
    batches = sum(len(s.batch_indices()) for s in open_store(out).manifest.shards)
    assert 2 <= chunk and batches % chunk not in (0, 1)  # an extra pass for one batch would show
    if reads[-1] == 0:  # the next chunk's block 0 read ahead, and no next chunk came
        reads.pop()
    assert reads == [chunk] * (batches // chunk) + [batches % chunk]
    shown = re.findall(r"block \d+/\d+", capsys.readouterr().err)
    assert set(shown) == {"block 1/3", "block 2/3"} and shown[0] == "block 1/3"  # blocks 0, 1 of 3 run


def test_sizes_and_limits_that_cannot_work_are_clear_errors(tiny_dirs, corpus, tmp_path):
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("500MB") == 500 * 10**6
    assert parse_size("1.5k") == 1500 and parse_size(4096) == 4096
    for bad in ("two gigs", "-1GB", "0", "5 parsecs"):
        with pytest.raises(HookscopeError, match="--max-memory"):
            parse_size(bad)
    with pytest.raises(HookscopeError, match="--max-memory .* with --generate"):
        _extract(tiny_dirs["gpt2"], corpus, tmp_path / "g", max_memory="1GB", generate=2)
    with pytest.raises(HookscopeError, match="largest block"):  # the embeddings alone are 128 KiB
        _extract(tiny_dirs["gpt2"], corpus, tmp_path / "small", max_memory="100KB")
    assert not (tmp_path / "small").exists() and not (tmp_path / "g").exists()


def test_max_memory_is_not_a_store_setting(tiny_dirs, corpus, tmp_path):
    """A store started in memory is finished streamed (the rows are the same)."""
    out = tmp_path / "s"
    _extract(tiny_dirs["gpt2"], corpus, out, max_tokens=640)
    summary = extract(ExtractConfig(**extract_config(tiny_dirs["gpt2"], corpus, out, max_memory=LIMIT)))
    assert summary.batches_skipped == 5 and summary.batches_done > 5


@pytest.fixture(scope="module")
def server(tiny_dirs) -> ForkServer:
    server = ForkServer.shared()
    server.warm("faultkit:load_model", path=str(tiny_dirs["gpt2"]))
    return server


# where a kill lands: a forward of the first chunk's early blocks, one in the middle of the run
# (inside a chunk), as a batch goes to the writer after the second chunk (between two chunks), and
# inside safetensors' own write of a shard, which the writer thread does while a chunk computes: a
# mid-chunk kill that landed there once left the library's temporary file (`shards/.tmpXXXXXX`)
# beside the shards, where the resume did not clean it (same rows, other files)
KILLS = {
    "first chunk, early block": "forward:0.05",
    "mid-chunk": "forward:0.5",
    "between chunks": "batch:next",
    "inside the library's shard write": "library-save:0.5",
}


@pytest.fixture(scope="module")
def reference(tiny_dirs, corpus, server, tmp_path_factory) -> tuple[dict, Path, dict[str, int], int]:
    """The uninterrupted streamed run every kill's resume is compared with: its config, its store,
    its events counted (to place the kills) and the plan's batches per chunk. One run for all."""
    out = tmp_path_factory.mktemp("stream-kills") / "ref"
    config = extract_config(tiny_dirs["gpt2"], corpus, out, max_memory=LIMIT)
    run = server.call(RUN, config=config, kill_at="count")
    assert run.status == 0, run.log[-3000:]
    chunk = streamer_for(
        hs.load(str(tiny_dirs["gpt2"]), device="meta"),
        POINTS,
        parse_size(LIMIT),
        batch_size=4,
        context=32,
        dtype=torch.bfloat16,
    ).plan.chunk_batches
    return config, out, run.result["counts"], chunk


@pytest.mark.parametrize("moment", list(KILLS))
@pytest.mark.slow
def test_a_kill_at_any_moment_resumes_byte_identically(moment, reference, server, tmp_path):
    config, ref, counts, chunk = reference
    assert 2 <= chunk and counts["batch"] > 3 * chunk  # several chunks of several batches
    site, at = KILLS[moment].split(":")
    # chunks of batches 1..chunk, chunk+1..2*chunk...: the second chunk's first goes to the writer
    n = chunk + 1 if at == "next" else max(1, int(float(at) * counts[site]))
    out = tmp_path / "killed"
    killed = server.call(RUN, config={**config, "out": str(out)}, kill_at=f"{site}:{n}")
    died_of = signal.SIGXFSZ if site == "library-save" else signal.SIGKILL
    assert killed.status == -died_of, killed.log[-3000:]
    resumed = server.call(RUN, config={**config, "out": str(out)})
    assert resumed.status == 0, resumed.log[-3000:]
    diff = compare_stores(out, ref)
    assert diff == {**diff, "rows_lost": 0, "rows_duplicated": 0, "same_values": True, "same_files": True}
