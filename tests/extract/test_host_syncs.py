"""The extraction's model stage never makes the host wait for the device, checked without a GPU.

On a GPU, reading a device tensor's value on the host (`.item()`, `bool(t)`, `int(t)`, `nonzero`
without a size, a boolean index, `torch.equal`, `.tolist()`) waits for every kernel queued before
it. `hookscope.profiling.host_reads.HostReads` records each such operation (with its Python stack)
during the model stage of a real `hs.extract` run (the executor's `InMemory.forward`) on the CPU:
every one it records would be a host wait per batch on a GPU. The inputs the model gets are
copies (as `.to("cuda")` makes them), and operations on the token mask the data stage made on the
host are left out: there they wait for nothing. tests/core/test_cuda.py runs the same path on a GPU under
`torch.cuda.set_sync_debug_mode("error")`.

The rows stay bit-identical: without the host check, transformers' mask builders take the path it
would have chosen (checked here against a plain forward hook on a model called with its mask,
byte for byte, for every attention family, sliding windows and eager attention included).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import family_models
import pytest
import torch
from helpers import corpus_fixture

import hookscope as hs
from hookscope.extract import ExtractConfig, InMemory, extract
from hookscope.model_inputs import unpadded
from hookscope.profiling.host_reads import HostReads
from hookscope.sources import batches, iter_documents, pack
from hookscope.testing import save_tiny, train_tokenizer

corpus = corpus_fixture(60)
SIZE = {"d_model": 64, "n_layers": 2, "n_heads": 4, "context": 64}
CONTEXT, BATCH = 16, 4
# family -> block 1's module path, written from the Hugging Face module tree (the reference hook)
BLOCK_1 = {
    "gpt2": "transformer.h.1",
    "llama": "model.layers.1",
    "gpt_neox": "gpt_neox.layers.1",
    "bert": "encoder.layer.1",
    "mixtral": "model.layers.1",
    "qwen2_moe": "model.layers.1",
    "qwen3_moe": "model.layers.1",
    "olmoe": "model.layers.1",
    "mistral": "model.layers.1",
    "mistral_window": "model.layers.1",
    "gemma2": "model.layers.1",
    "gemma2_window": "model.layers.1",
    "qwen3": "model.layers.1",
}
SAVED = ("gpt2", "llama", "gpt_neox", "bert", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# built from their own configs (case -> model type, config): the default sliding window (longer
# than the context: the mask check runs) and one shorter than the context (the mask is built)
BUILT = {
    "mistral": ("mistral", {}),
    "mistral_window": ("mistral", {"sliding_window": 6}),
    "gemma2": ("gemma2", {}),
    "gemma2_window": ("gemma2", {"sliding_window": 6}),
    "qwen3": ("qwen3", {}),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("syncs")
    dirs = {family: save_tiny(family, root / family, **SIZE) for family in SAVED}
    for case, (kind, overrides) in BUILT.items():
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(family_models._config(kind, overrides))
        model.save_pretrained(root / case)
        train_tokenizer(family_models.VOCAB).save_pretrained(root / case)
        dirs[case] = root / case
    return dirs


def run_extract(model_dir: Path, corpus: Path, out: Path, **options) -> None:
    extract(
        ExtractConfig(
            out=str(out),
            model=str(model_dir),
            points=["blocks.1.resid_post"],
            data=str(corpus),
            context=CONTEXT,
            batch_size=BATCH,
            dtype="float32",
            device="cpu",
            progress=False,
            max_tokens=CONTEXT * BATCH * 3,
            **options,
        )
    )


def counted_extract(monkeypatch, model_dir: Path, corpus: Path, out: Path) -> list[list[str]]:
    """`hs.extract` of blocks.1.resid_post, the host reads of each batch's model stage."""
    per_batch: list[list[str]] = []
    forward = InMemory.forward

    def counted(self, batch, lender=None):
        call = self.source.call_of(batch, self.run_on.device)
        host = {
            t.untyped_storage().data_ptr()
            for t in [call.keep, *(call.columns or {}).values()]
            if t is not None
        }
        on_device = type(batch)(batch)  # the inputs as the device gets them: copies
        on_device.call = dataclasses.replace(call, inputs={k: v.clone() for k, v in call.inputs.items()})
        with HostReads(host) as reads:
            rows = forward(self, on_device, lender)
        per_batch.append(reads.calls)
        return rows

    monkeypatch.setattr(InMemory, "forward", counted)
    run_extract(model_dir, corpus, out)
    return per_batch


def reference_rows(model_dir: Path, corpus: Path, family: str) -> torch.Tensor:
    """Block 1's output through a plain forward hook, the model called with its attention mask."""
    loaded = hs.load(str(model_dir))
    block = loaded.model.get_submodule(BLOCK_1[family])
    rows, kept = [], []
    handle = block.register_forward_hook(
        lambda m, a, out: kept.append(out[0] if isinstance(out, tuple) else out)
    )
    try:
        sequences = pack(
            iter_documents(str(corpus)), loaded.tokenizer, context=CONTEXT, max_tokens=CONTEXT * BATCH * 3
        )
        for batch in batches(sequences, BATCH):
            kept.clear()
            with torch.inference_mode():
                loaded.model(
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
                )
            rows.append(kept[0][batch["attention_mask"].bool() & ~batch["special_mask"].bool()])
    finally:
        handle.remove()
    return torch.cat(rows)


@pytest.mark.parametrize("family", list(BLOCK_1))
@pytest.mark.slow
def test_the_model_stage_reads_nothing_on_the_host_and_rows_stay_bit_identical(
    monkeypatch, model_dirs, corpus, tmp_path, family
):
    per_batch = counted_extract(monkeypatch, model_dirs[family], corpus, tmp_path / "store")
    assert len(per_batch) == 3
    assert per_batch == [[]] * 3, (
        f"{family}: host reads in the model stage (a host wait per batch on a "
        "GPU):\n" + "\n".join(per_batch[0])
    )
    got = hs.open_store(str(tmp_path / "store")).tensor("blocks.1.resid_post")
    want = reference_rows(model_dirs[family], corpus, family)
    assert got.shape == want.shape and got.view(torch.int32).equal(want.view(torch.int32))  # byte for byte


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_a_streamed_run_reads_nothing_on_the_host_either(monkeypatch, model_dirs, corpus, tmp_path, family):
    """Under --max-memory every block's pass builds the masks again (blocks x batches checks per
    chunk before): none reads on the host, and the rows are the plain hook's, byte for byte."""
    from hookscope.loading import streamer as streaming
    from hookscope.loading.streamer import BlockStreamer

    # on a GPU the input embedding stays in device memory (test_stream_buffers checks that a GPU run
    # never reads it by rows); the CPU-only row reads read the token ids on the host by design
    monkeypatch.setattr(streaming, "embedding_rows_for", lambda model, locate, device: None)
    chunks: list[list[str]] = []
    run_chunk = BlockStreamer.run_chunk

    def counted(self, inputs, keeps):
        host = {k.untyped_storage().data_ptr() for k in keeps if k is not None}
        if self.buffers is not None:  # the weights' host slots and staging, read from the files
            host |= {
                t.untyped_storage().data_ptr()
                for t in [*(w for w, _ in self.buffers.host), *self.buffers._staging]
            }
        on_device = [{k: v.clone() for k, v in batch.items()} for batch in inputs]
        with HostReads(host) as reads:
            acts = run_chunk(self, on_device, keeps)
        chunks.append(reads.calls)
        return acts

    monkeypatch.setattr(BlockStreamer, "run_chunk", counted)
    run_extract(model_dirs[family], corpus, tmp_path / "store", max_memory="1MB")
    assert chunks and all(calls == [] for calls in chunks), "\n".join(chunks[0])
    got = hs.open_store(str(tmp_path / "store")).tensor("blocks.1.resid_post")
    want = reference_rows(model_dirs[family], corpus, family)
    assert got.shape == want.shape and got.view(torch.int32).equal(want.view(torch.int32))


def test_the_counter_sees_the_mask_check_a_plain_call_makes(model_dirs):
    """The counter is not blind: a model called with its all-ones mask outside `unpadded` reads it
    on the host (transformers' check), and one called with no mask reads its position ids; copies
    to the host are seen on a CPU tensor too."""
    model = hs.load(str(model_dirs["llama"])).model
    ids = torch.randint(1, 100, (2, 8))
    with torch.inference_mode():
        with HostReads() as with_mask:
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
        with HostReads() as without:
            model(input_ids=ids, use_cache=False)
        with HostReads() as inside, unpadded():
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    assert with_mask.calls and "_ignore_causal_mask_sdpa" in with_mask.calls[0]
    assert without.calls and "find_packed_sequence_indices" in without.calls[0]
    assert inside.calls == []
    with HostReads() as copies:  # what a CPU run sees only at the function level
        torch.arange(3).tolist()
        torch.arange(3).cpu()
    assert [c.split(" at ")[0] for c in copies.calls] == ["Tensor.tolist", "Tensor.cpu"]
    with HostReads(device_only=True) as on_a_device:  # a CPU tensor's read waits for no device
        torch.arange(3).tolist()
        assert bool(torch.arange(3).sum() > 0)
    assert on_a_device.calls == []


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "bert", "mistral_window"])
def test_unpadded_changes_no_bit_and_a_padded_mask_still_masks(model_dirs, family, attention):
    """Inside `unpadded` an all-ones mask gives the outputs the model gives with it outside, bit for
    bit (sdpa and eager, a causal, a bidirectional and a sliding-window family); a mask with padding
    is honoured outside `unpadded` and where the caller does not know the batch unpadded."""
    model = hs.load(str(model_dirs[family])).model
    model.config._attn_implementation = attention
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 100, (3, CONTEXT), generator=g)
    ones, padded = torch.ones_like(ids), torch.ones_like(ids)
    padded[1, 9:] = 0

    def hidden(mask):
        with torch.inference_mode():
            return model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]

    plain = hidden(ones)
    with unpadded():
        fast = hidden(ones)
    assert fast.view(torch.int32).equal(plain.view(torch.int32))
    masked = hidden(padded)
    with unpadded(known=False):
        assert hidden(padded).equal(masked)
    # the padded row's padding positions see fewer keys than with no padding (every family)
    assert not torch.allclose(masked[1, 9:], plain[1, 9:])


@pytest.mark.slow
def test_a_fully_compiled_model_traces_through_the_wrapped_mask_builders(model_dirs):
    """Once `unpadded` has wrapped transformers' mask builders (process-wide), a user's model
    compiled whole (`fullgraph=True`: a graph break is an error) still compiles and still masks
    its padding; inside `unpadded` its outputs are unchanged too."""
    model = hs.load(str(model_dirs["llama"])).model
    ids = torch.randint(1, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    padded = torch.ones_like(ids)
    padded[1, 5:] = 0
    with torch.inference_mode():
        with unpadded():
            pass  # the builders are wrapped from here on
        want = model(input_ids=ids, attention_mask=padded).logits
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(input_ids=ids, attention_mask=padded).logits, want)
        with unpadded():
            got = compiled(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        torch.testing.assert_close(got, model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits)


@pytest.mark.parametrize("name", ["sdpa", "flash_attention_2"])
def test_a_wrapped_mask_builder_reads_nothing_inside_unpadded_and_masks_padding_outside(name):
    """transformers' builders as its models call them (the registry by name): an all-ones mask is
    read on the host outside `unpadded` (flash attention's builder too, which a CPU model never
    runs) and not inside, with the same mask built (None: no mask at all); a padded one is kept."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    with unpadded():
        pass  # the builders are wrapped from here on
    build = ALL_MASK_ATTENTION_FUNCTIONS[name]
    ones = torch.ones(2, 8, dtype=torch.bool)
    padded = ones.clone()
    padded[1, 6:] = False
    shape = {"batch_size": 2, "q_length": 8, "kv_length": 8}
    with HostReads() as outside:
        plain = build(**shape, attention_mask=ones)
    with HostReads() as inside, unpadded():
        fast = build(**shape, attention_mask=ones)
    assert outside.calls and inside.calls == []
    assert plain is None and fast is None
    kept = build(**shape, attention_mask=padded)
    assert kept is not None and not bool(kept.all())
