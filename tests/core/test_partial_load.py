"""`hs.load(model, points=[...])`: only the weights the points need leave the `meta` device.

References are independent of hookscope: a plain `from_pretrained` of the whole model with a bare
`register_forward_hook` on the block's module path written here, and per family a hand-written
list of the parameters a point at block 1 needs (the embeddings, blocks 0 and 1, nothing else).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_padding import block_output
from torch import nn

import hookscope as hs
from hookscope.errors import PointNotLoadedError
from hookscope.hooks import hook_count
from hookscope.testing import FAMILIES, MOE_FAMILIES, SSM_FAMILIES, VISION_FAMILIES, save_tiny

SIZE = {"d_model": 64, "n_layers": 3, "n_heads": 4, "context": 64}

# family -> (block module path, with {L}; the parameters before the first block that a block needs)
PATCHES = {"embeddings.patch_embeddings.projection.weight", "embeddings.patch_embeddings.projection.bias"}
EXPECTED = {
    "gpt2": ("transformer.h.{L}", {"transformer.wte.weight", "transformer.wpe.weight"}),
    "llama": ("model.layers.{L}", {"model.embed_tokens.weight"}),
    "gpt_neox": ("gpt_neox.layers.{L}", {"gpt_neox.embed_in.weight"}),
    "bert": (
        "encoder.layer.{L}",
        {
            f"embeddings.{name}"
            for name in (
                "word_embeddings.weight",
                "position_embeddings.weight",
                "token_type_embeddings.weight",
                "LayerNorm.weight",
                "LayerNorm.bias",
            )
        },
    ),
    **{moe: ("model.layers.{L}", {"model.embed_tokens.weight"}) for moe in MOE_FAMILIES},
    "vit": ("layers.{L}", {"embeddings.cls_token", "embeddings.position_embeddings", *PATCHES}),
    "clip_vision_model": (
        "encoder.layers.{L}",
        {
            "embeddings.class_embedding",
            "embeddings.patch_embedding.weight",
            "embeddings.position_embedding.weight",
            "pre_layrnorm.weight",
            "pre_layrnorm.bias",
        },
    ),
    "siglip_vision_model": (
        "encoder.layers.{L}",
        {
            "embeddings.patch_embedding.weight",
            "embeddings.patch_embedding.bias",
            "embeddings.position_embedding.weight",
        },
    ),
    "dinov2": (
        "encoder.layer.{L}",
        {"embeddings.cls_token", "embeddings.mask_token", "embeddings.position_embeddings", *PATCHES},
    ),
    "dinov2_with_registers": (
        "encoder.layer.{L}",
        {
            "embeddings.cls_token",
            "embeddings.mask_token",
            "embeddings.register_tokens",
            "embeddings.position_embeddings",
            *PATCHES,
        },
    ),
    "mamba": ("backbone.layers.{L}", {"backbone.embeddings.weight"}),
    "rwkv": ("rwkv.blocks.{L}", {"rwkv.embeddings.weight"}),
}
ALL = FAMILIES + MOE_FAMILIES + VISION_FAMILIES + SSM_FAMILIES


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("partial")
    made: dict[str, Path] = {}

    class Dirs(dict):
        def __missing__(self, family: str) -> Path:
            made[family] = save_tiny(family, root / family, **SIZE)
            return made[family]

    return Dirs()


def plain_model(path: Path, dtype: torch.dtype | None = None) -> nn.Module:
    """The whole model through transformers alone."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    arch = AutoConfig.from_pretrained(path).architectures[0]
    auto = AutoModelForCausalLM if arch.endswith(("ForCausalLM", "LMHeadModel")) else AutoModel
    return auto.from_pretrained(path, **({"dtype": dtype} if dtype else {})).eval()


def inputs_for(family: str, vocab: int = 100) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if family in VISION_FAMILIES:
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=g)}
    return {"input_ids": torch.randint(1, vocab, (2, 7), generator=g)}


def hooked_output(model: nn.Module, module_path: str, inputs: dict) -> torch.Tensor:
    """A module's output through a bare torch forward hook (the first element of a tuple)."""
    return block_output(model, model.get_submodule(module_path), inputs)


def off_meta(model: nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if not p.is_meta}


def expected_names(family: str, full: nn.Module, through: int) -> set[str]:
    block, prologue = EXPECTED[family]
    blocks = tuple(block.format(L=i) + "." for i in range(through + 1))
    return prologue | {name for name, _ in full.named_parameters() if name.startswith(blocks)}


@pytest.mark.parametrize("family", ALL)
def test_points_load_gives_the_full_models_values_and_only_the_needed_weights(saved, family):
    path = saved[family]
    full = plain_model(path)
    loaded = hs.load(str(path), tokenizer=False, points=["blocks.1.resid_post"])
    inputs = inputs_for(family)
    want = hooked_output(full, EXPECTED[family][0].format(L=1), inputs)
    got = hs.collect(loaded.model, inputs, "blocks.1.resid_post")["blocks.1.resid_post"]
    assert torch.equal(got, want)
    # counted against the hand-written list: block 2, the final norm and any head stay on meta
    assert off_meta(loaded.model) == expected_names(family, full, through=1)
    assert len(off_meta(loaded.model)) < len(dict(full.named_parameters()))
    assert not any(
        b.is_meta
        for name, b in loaded.model.named_buffers()
        if not name.startswith(EXPECTED[family][0].format(L=2))
    )


def test_a_point_past_the_load_is_a_clear_error(saved):
    loaded = hs.load(str(saved["llama"]), tokenizer=False, points="blocks.0.resid_post")
    ids = inputs_for("llama")["input_ids"]
    for point in (
        "blocks.1.resid_post",
        "blocks.2.attn.q",
        "ln_final",
        "logits",
        "module:model.layers.1.mlp:output",
        "module:model.norm:output",
    ):
        with pytest.raises(PointNotLoadedError) as info:
            hs.collect(loaded.model, ids, ["blocks.0.resid_post", point])
        message = str(info.value)
        assert "blocks 0-0 of 3" in message and "points=['blocks.0.resid_post'," in message
        assert "without points=" in message
    assert hook_count(loaded.model) == 1  # only the guard below: the refused hooks left nothing
    # a pass that is not stopped after its point reaches block 1: a hookscope error, not torch's
    with pytest.raises(PointNotLoadedError, match="reached model.layers.1"):
        with hs.capture(loaded.model, "blocks.0.resid_post"):
            loaded.model(ids)
    # loaded through the last block: the final norm and head are what a pass must not reach
    through_last = hs.load(str(saved["llama"]), tokenizer=False, points="blocks.2.resid_post").model
    with pytest.raises(PointNotLoadedError, match="reached model.norm"):
        with hs.capture(through_last, "blocks.2.resid_post"):
            through_last(ids)
    # the points it was loaded for, and those before them, still work
    got = hs.collect(loaded.model, ids, ["embed", "blocks.0.attn.q", "module:model.layers.0.mlp:output"])
    assert set(got) == {"embed", "blocks.0.attn.q", "module:model.layers.0.mlp:output"}


def test_a_point_after_the_blocks_loads_everything(saved):
    path = saved["gpt2"]  # a tied LM head: the checkpoint has no lm_head.weight
    full = plain_model(path)
    loaded = hs.load(str(path), tokenizer=False, points=["logits"])
    ids = inputs_for("gpt2")["input_ids"]
    with torch.no_grad():
        want = full(ids).logits
    assert torch.equal(hs.collect(loaded.model, ids, "logits")["logits"], want)
    assert off_meta(loaded.model) == set(dict(full.named_parameters()))
    assert loaded.model.lm_head.weight is loaded.model.transformer.wte.weight


def test_sharded_checkpoint(saved, tmp_path):
    full = plain_model(saved["llama"])
    full.save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    loaded = hs.load(str(tmp_path), tokenizer=False, points=["blocks.1.mlp.out"])
    ids = inputs_for("llama")["input_ids"]
    want = hooked_output(full, "model.layers.1.mlp", {"input_ids": ids})
    assert torch.equal(hs.collect(loaded.model, ids, "blocks.1.mlp.out")["blocks.1.mlp.out"], want)
    assert off_meta(loaded.model) == expected_names("llama", full, through=1)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_pickled_bin_checkpoint_loads_per_tensor_too(saved, tmp_path, sharded):
    """Only `pytorch_model.bin` (as torch.save writes it): read through torch.load's memory map,
    the needed tensors only, the same values as the safetensors checkpoint's full load."""
    full = plain_model(saved["llama"])
    (tmp_path / "config.json").write_bytes((saved["llama"] / "config.json").read_bytes())
    state = full.state_dict()
    if sharded:  # two files and the index transformers writes for them
        names = sorted(state)
        halves = {f"pytorch_model-0000{i + 1}-of-00002.bin": names[i::2] for i in range(2)}
        for file, keys in halves.items():
            torch.save({k: state[k] for k in keys}, tmp_path / file)
        weight_map = {k: file for file, keys in halves.items() for k in keys}
        (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        torch.save(state, tmp_path / "pytorch_model.bin")
    assert not list(tmp_path.glob("*.safetensors"))
    loaded = hs.load(str(tmp_path), tokenizer=False, points=["blocks.1.resid_post"])
    assert off_meta(loaded.model) == expected_names("llama", full, through=1)
    params = dict(full.named_parameters())
    assert all(torch.equal(p, params[n]) for n, p in loaded.model.named_parameters() if not p.is_meta)
    ids = inputs_for("llama")
    want = hooked_output(full, "model.layers.1", ids)
    assert torch.equal(hs.collect(loaded.model, ids, "blocks.1.resid_post")["blocks.1.resid_post"], want)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_dtype_conversion_equals_the_full_load_converted(saved, family, monkeypatch):
    import hookscope.loading.checkpoint

    monkeypatch.setattr(hookscope.loading.checkpoint, "_CHUNK_BYTES", 1000)  # many chunks per tensor
    chunked = []
    read_whole = hookscope.loading.checkpoint._Converting.__getitem__
    monkeypatch.setattr(
        hookscope.loading.checkpoint._Converting,
        "__getitem__",
        lambda self, index: chunked.append(self.key) or read_whole(self, index),
    )
    path = saved[family]
    full = plain_model(path, dtype=torch.bfloat16)
    loaded = hs.load(str(path), tokenizer=False, dtype=torch.bfloat16, points=["blocks.1.resid_post"])
    assert {p.dtype for p in loaded.model.parameters() if not p.is_meta} == {torch.bfloat16}
    ids = inputs_for(family)
    want = hooked_output(full, "model.layers.1", ids)
    got = hs.collect(loaded.model, ids, "blocks.1.resid_post")["blocks.1.resid_post"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert len(chunked) > 10  # the float32 checkpoint was read in converted chunks
    # the weights themselves: the same bytes as transformers' own conversion
    state = dict(full.named_parameters())
    for name, param in loaded.model.named_parameters():
        if not param.is_meta:
            assert torch.equal(param, state[name]), name


@pytest.mark.parametrize(("config_names_it", "safe"), [(True, True), (False, True), (False, False)])
def test_no_dtype_loads_the_checkpoints_dtype_as_from_pretrained_does(saved, tmp_path, config_names_it, safe):
    """A bfloat16 checkpoint loaded with no dtype: transformers keeps bfloat16 (its default "auto",
    from the config, else from the first floating weight); points= once loaded it as float32, so
    `extract` (which loads with points=) ran a bf16 model at twice the memory, on other kernels."""
    path = tmp_path / "bf16"
    plain_model(saved["llama"]).to(torch.bfloat16).save_pretrained(path, safe_serialization=safe)
    if not config_names_it:
        config = json.loads((path / "config.json").read_text())
        config.pop("dtype", None), config.pop("torch_dtype", None)
        (path / "config.json").write_text(json.dumps(config))
    full = plain_model(path)
    assert full.dtype == torch.bfloat16  # what a user gets from transformers alone
    loaded = hs.load(str(path), tokenizer=False, points=["blocks.1.resid_post"])
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    weightless = hs.load(str(path), tokenizer=False, device="meta").model  # what --max-memory streams into
    assert {p.dtype for p in weightless.parameters()} == {torch.bfloat16}
    ids = inputs_for("llama")
    want = hooked_output(full, "model.layers.1", ids)
    assert torch.equal(hs.collect(loaded.model, ids, "blocks.1.resid_post")["blocks.1.resid_post"], want)


def test_a_base_model_checkpoint_under_a_head_class(saved, tmp_path):
    """Keys without the `model.` prefix (a LlamaModel's weights) loaded as LlamaForCausalLM."""
    base = plain_model(saved["llama"]).model
    base.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert not any(k.startswith("model.") for k in load_file(tmp_path / "model.safetensors"))
    loaded = hs.load(str(tmp_path), tokenizer=False, points=["blocks.1.resid_post"])
    assert type(loaded.model).__name__ == "LlamaForCausalLM"
    ids = inputs_for("llama")
    want = hooked_output(base, "layers.1", ids)
    assert torch.equal(hs.collect(loaded.model, ids, "blocks.1.resid_post")["blocks.1.resid_post"], want)


@pytest.mark.parametrize("device_map", [{"": "cpu"}, "per-module"])
def test_device_map_spreads_only_the_needed_modules(saved, device_map):
    path = saved["llama"]
    if device_map == "per-module":
        device_map = {
            "model.embed_tokens": "cpu",
            "model.rotary_emb": "cpu",
            "model.layers": "cpu",
            "model.norm": "cpu",
            "lm_head": "cpu",
        }
    full = plain_model(path)
    loaded = hs.load(str(path), tokenizer=False, device_map=device_map, points=["blocks.0.resid_post"])
    ids = inputs_for("llama")
    want = hooked_output(full, "model.layers.0", ids)
    assert torch.equal(hs.collect(loaded.model, ids, "blocks.0.resid_post")["blocks.0.resid_post"], want)
    assert off_meta(loaded.model) == expected_names("llama", full, through=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="'auto' places on the GPU there: test_cuda.py")
def test_device_map_auto_sizes_the_needed_modules_alone(saved):
    path = saved["llama"]
    full = plain_model(path)
    loaded = hs.load(str(path), tokenizer=False, device_map="auto", points=["blocks.1.resid_post"])
    ids = inputs_for("llama")
    want = hooked_output(full, "model.layers.1", ids)
    assert torch.equal(hs.collect(loaded.model, ids, "blocks.1.resid_post")["blocks.1.resid_post"], want)
    assert off_meta(loaded.model) == expected_names("llama", full, through=1)
    # the module tree is whole again, in its order, after accelerate looked at the needed part
    assert [n for n, _ in loaded.model.named_children()] == [n for n, _ in full.named_children()]
    assert [n for n, _ in loaded.model.model.named_children()] == [n for n, _ in full.model.named_children()]


def test_device_map_auto_budgets_the_needed_modules_alone(saved, monkeypatch):
    """Two simulated 500 kB GPUs: the needed modules (605 kB) fit there, the whole model (965 kB)
    would not (accelerate counts a parameter on meta like any other, hence the reference below), so
    the map spreads the embeddings and blocks 0-1 over both GPUs and names nothing else. The
    weights are not placed (no GPU here)."""
    import accelerate.utils.modeling as modeling
    from accelerate.utils import infer_auto_device_map

    import hookscope.loading.checkpoint

    budget = {0: 500_000, 1: 500_000, "cpu": 10**9}
    real_max_memory = modeling.get_max_memory
    monkeypatch.setattr(modeling, "get_max_memory", lambda given=None: real_max_memory(given or dict(budget)))
    placed = []

    class Placed(Exception):
        pass

    def spy(self, model, wants, device_map):
        placed.append(device_map)
        raise Placed

    monkeypatch.setattr(hookscope.loading.checkpoint.Checkpoint, "materialize", spy)
    with pytest.raises(Placed):
        hs.load(str(saved["llama"]), tokenizer=False, device_map="auto", points=["blocks.1.resid_post"])
    full = plain_model(saved["llama"])
    needed = expected_names("llama", full, through=1)
    (device_map,) = placed
    assert set(device_map.values()) == {0, 1}  # spread over both GPUs, nothing offloaded
    # every module the map names holds a needed tensor (a key may be a container: model.layers)
    held = needed | {"model.rotary_emb.inv_freq"}  # (the rotary table: a buffer, no parameter)
    assert all(any(n.startswith(prefix + ".") for n in held) for prefix in device_map)
    assert all(any(not k or n.startswith(k + ".") for k in device_map) for n in needed)
    # the reference: the whole model under the same budget spills past the GPUs
    assert (
        "cpu"
        in infer_auto_device_map(
            full, max_memory=dict(budget), no_split_module_classes=full._no_split_modules
        ).values()
    )


def test_a_device_map_for_the_whole_model_places_the_needed_part(saved):
    """A map written for the whole model over two devices, of which the needed modules use one:
    nothing is dispatched for the other (a GPU this machine does not have, never touched)."""
    device_map = {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "cpu",
        "model.layers.2": 1,
        "model.norm": 1,
        "lm_head": 1,
    }
    full = plain_model(saved["llama"])
    loaded = hs.load(
        str(saved["llama"]), tokenizer=False, device_map=device_map, points=["blocks.1.resid_post"]
    )
    ids = inputs_for("llama")
    want = hooked_output(full, "model.layers.1", ids)
    assert torch.equal(hs.collect(loaded.model, ids, "blocks.1.resid_post")["blocks.1.resid_post"], want)
    assert off_meta(loaded.model) == expected_names("llama", full, through=1)


def test_extract_loads_only_what_its_points_need(saved, tmp_path, monkeypatch):
    """The same shard bytes as from the whole model; the model it ran had block 2 on meta."""
    from hookscope.extract import loop as extract_loop  # (hookscope.extract.loop reads the function)

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Document {i}: the residual stream, layer by layer." for i in range(12)))
    seen = []
    real_load = extract_loop.load

    def spying_load(*args, **kwargs):
        loaded = real_load(*args, **kwargs)
        seen.append(off_meta(loaded.model))
        return loaded

    def run(out: Path) -> dict[str, bytes]:
        hs.extract(
            hs.ExtractConfig(
                out=str(out),
                model=str(saved["llama"]),
                points=["blocks.1.resid_post"],
                data=str(corpus),
                context=16,
                batch_size=2,
                dtype="float32",
                shard_rows=40,
                progress=False,
            )
        )
        return {p.name: p.read_bytes() for p in sorted((out / "shards").glob("*"))}

    monkeypatch.setattr(extract_loop, "load", spying_load)
    partial = run(tmp_path / "partial")
    monkeypatch.setattr(extract_loop, "load", lambda *a, **k: spying_load(*a, **{**k, "points": None}))
    whole = run(tmp_path / "whole")
    full = plain_model(saved["llama"])
    assert seen == [expected_names("llama", full, through=1), set(dict(full.named_parameters()))]
    assert len(partial) > 1 and partial == whole
    manifests = [json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("partial", "whole")]
    assert manifests[0]["settings"] == manifests[1]["settings"]


def test_a_block_materialized_later_and_released(saved):
    """What block streaming builds on: one block's weights in from the files, then back to meta."""
    from hookscope.loading.checkpoint import Checkpoint
    from hookscope.loading.weight_files import checkpoint_files

    path = saved["llama"]
    full = plain_model(path)
    model = hs.load(str(path), tokenizer=False, points="blocks.0.resid_post").model
    checkpoint = Checkpoint(model, checkpoint_files(str(path)), torch.float32)
    block = "model.layers.2."
    checkpoint.materialize(model, lambda name: name.startswith(block), {"": "cpu"})
    full_state = dict(full.named_parameters())
    brought = {n: p for n, p in model.named_parameters() if n.startswith(block)}
    assert brought and all(torch.equal(p, full_state[n]) for n, p in brought.items())
    assert off_meta(model) == expected_names("llama", full, through=0) | set(brought)
    checkpoint.release(model, ["model.layers.2"])
    checkpoint.close()
    assert off_meta(model) == expected_names("llama", full, through=0)
