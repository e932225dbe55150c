"""Block streaming (`--max-memory`) on a tiny model of every family in tests/kit/family_models.py: the
streamed store is the in-memory store byte for byte, its values are those of plain forward hooks
on a model loaded by transformers itself, a SIGKILL at three moments resumes to the same bytes for
a model of each kind, and two torchrun ranks stream the same shards as two in-memory ranks.

The models are float64 and nudged off their initial values (family_models.build), so a block run
with the wrong weights or the wrong input cannot give the right rows by accident. RWKV is also
saved with `rescale_every=1`: in inference it divides block k's output weights by 2**k on its
first forward and halves the stream after every block, so a streamed block that missed (or got
twice) that rescaling gives other rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import family_models
import pytest
import torch
from elastic_kit import run_ranks
from faultkit import compare_stores, write_corpus
from forkserver import ForkServer
from source_kit import write_images

import hookscope as hs
from hookscope.extract import ExtractConfig, extract
from hookscope.extract_config import Run
from hookscope.loading.stream_plan import plan_stream
from hookscope.sources import source_for
from hookscope.store import open_store
from hookscope.testing import image_processor, train_tokenizer

POINTS = ["blocks.0.resid_post", "blocks.1.resid_post"]  # family_models' models have two blocks
# case -> config overrides on top of family_models.build(case's model)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    **{case: (case, {}) for case in family_models.CASES},
    "rwkv_rescaled": ("rwkv", {"rescale_every": 1}),
}
# saved in float32: transformers' fused experts (grouped_mm) take no float64, and the eager experts
# family_models.build asks for are a setting `save_pretrained` does not keep
FLOAT32 = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe"}
# text: 6 batches of 4 x 16 tokens; images: 5 batches of 2. Streamed in chunks of two batches (limit_for),
# after batch 1 alone (the loop's check before the store opens): at least two chunks, one partial
TEXT_BATCHES, PICTURES = 6, 10
SAME = {"rows_lost": 0, "rows_duplicated": 0, "same_values": True, "same_files": True}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("stream-families")
    return {
        "text": str(write_corpus(root / "corpus.txt", docs=30)),
        "images": f"images:{write_images(root / 'pictures', PICTURES)}",
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> the case's model saved with its tokenizer (or image processor), made on first use."""
    root = tmp_path_factory.mktemp("family-models")
    made: dict[str, Path] = {}

    def save(case: str) -> Path:
        if case not in made:
            model_case, overrides = CASES[case]
            model = family_models.build(model_case)
            for key, value in overrides.items():
                setattr(model.config, key, value)
            if model_case in FLOAT32:
                model.float()
            model.save_pretrained(root / case)
            if model_case in family_models.VISION:
                image_processor(family_models.CASES[model_case][0]).save_pretrained(root / case)
            else:
                train_tokenizer(family_models.VOCAB, bert=model_case == "bert").save_pretrained(root / case)
            made[case] = root / case
        return made[case]

    return save


def is_vision(case: str) -> bool:
    return CASES[case][0] in family_models.VISION


def fields(case: str, model_dir: Path, data: dict[str, str], out: Path, **overrides: Any) -> dict[str, Any]:
    """ExtractConfig fields of a small run: several chunks of two batches each once streamed."""
    if is_vision(case):
        base = {"data": data["images"], "batch_size": 2}
    else:
        base = {"data": data["text"], "context": 16, "batch_size": 4, "max_tokens": 16 * 4 * TEXT_BATCHES}
    return {
        "model": str(model_dir),
        "out": str(out),
        "points": POINTS,
        "dtype": "float32",
        "shard_rows": 100,
        "progress": False,
        **base,
        **overrides,
    }


def limit_for(config: dict[str, Any], batches_per_chunk: int = 2) -> int:
    """A --max-memory under which a chunk holds `batches_per_chunk` batches: the weights' share and
    one batch's share read off the plan (so this holds whatever the plan's formula), then checked."""
    cfg = ExtractConfig(**config)
    kind = source_for(cfg)
    loaded = hs.load(cfg.model, device="meta", tokenizer=kind.needs_tokenizer)
    tokens = kind.open(cfg, loaded, cfg.points, Run(0, 1, "cpu")).item_tokens()

    def plan(limit: int):
        return plan_stream(
            loaded.model,
            loaded.arch,
            cfg.points,
            limit,
            batch_size=cfg.batch_size,
            context=tokens,
            store_itemsize=4,
        )

    weights, spare = plan(10**12).weight_limit, 10**9
    per_batch = spare / plan(weights + spare).chunk_batches
    limit = weights + int(per_batch * (batches_per_chunk + 0.5))
    assert plan(limit).chunk_batches == batches_per_chunk
    return limit


# one model of each kind, its block 1 as a module path written here (the model as transformers builds it)
REFERENCE = {
    "gemma3_text": "model.layers.1",
    "bert": "encoder.layer.1",
    "qwen2_moe": "model.layers.1",
    "siglip": "encoder.layers.1",
    "dinov2_with_registers": "encoder.layer.1",
    "rwkv_rescaled": "rwkv.blocks.1",
    "falcon_mamba": "backbone.layers.1",
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_a_streamed_store_is_the_in_memory_store_byte_for_byte(case, saved, data, tmp_path):
    """Every family, on CPU (each batch goes through each block with the shapes of a whole forward
    pass, so the bits are the same): the shard files and the manifest, byte for byte. For one model
    of each kind (REFERENCE), the streamed store's blocks.1.resid_post also equals a forward hook on
    block 1 of the model `from_pretrained` loads whole, run on the same batches (token ids read back
    from the store, so every token is kept; pictures through the image processor, in file order)."""
    every_token = {"drop_bos": False} if case in REFERENCE and not is_vision(case) else {}
    config = fields(case, saved(case), data, tmp_path / "memory", **every_token)
    extract(ExtractConfig(**config))
    limit = limit_for(config)
    streamed = {**config, "out": str(tmp_path / "streamed"), "max_memory": limit}
    extract(ExtractConfig(**streamed))
    diff = compare_stores(tmp_path / "streamed", tmp_path / "memory")
    assert diff == {**diff, **SAME}
    assert diff["rows"] > 0
    if case in REFERENCE:
        store = open_store(tmp_path / "streamed")
        assert torch.equal(
            store.tensor("blocks.1.resid_post"), _plain_hook_rows(case, saved, store, streamed)
        )


def _plain_hook_rows(case: str, saved, store, config: dict[str, Any]) -> torch.Tensor:
    """Block 1's outputs, by a forward hook on the model transformers loads whole, over the store's
    batches."""
    from transformers import AutoModel, AutoModelForCausalLM

    auto = AutoModel if is_vision(case) or case == "bert" else AutoModelForCausalLM
    model = auto.from_pretrained(saved(case)).eval()
    outputs: list[torch.Tensor] = []
    model.get_submodule(REFERENCE[case]).register_forward_hook(
        lambda m, a, out: outputs.append(out[0] if isinstance(out, tuple) else out)
    )
    with torch.inference_mode():
        for batch in _batches(case, store, config):
            model(**batch)
    return torch.cat([o.flatten(0, 1) for o in outputs]).float()


def _batches(case: str, store, config: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
    size = config["batch_size"]  # the extraction's batches: the same shapes, so the same bits
    if not is_vision(case):
        ids = store.tensor("token_ids").reshape(-1, config["context"])  # every token kept: whole sequences
        return [{"input_ids": b, "attention_mask": torch.ones_like(b)} for b in ids.split(size)]
    from PIL import Image

    folder = Path(config["data"].removeprefix("images:"))
    pictures = [Image.open(p).convert("RGB") for p in sorted(folder.iterdir())]
    processor = image_processor(family_models.CASES[CASES[case][0]][0])
    return [
        {"pixel_values": processor(images=pictures[i : i + size], return_tensors="pt")["pixel_values"]}
        for i in range(0, len(pictures), size)
    ]


def test_a_picture_is_sized_as_its_patches_and_extra_tokens(saved, data, tmp_path):
    """The chunk size counts the tokens a picture becomes, as the model's config says: a 4x4 grid of
    8-pixel patches on 32x32 pictures, + CLS (ViT, CLIP, DINOv2), + 4 registers, none for SigLIP."""
    want = {"vit": 17, "clip": 17, "siglip": 16, "dinov2": 17, "dinov2_with_registers": 21}
    for case, tokens in want.items():
        config = fields(case, saved(case), data, tmp_path / case)
        cfg = ExtractConfig(**config)
        loaded = hs.load(cfg.model, device="meta", tokenizer=False)
        source = source_for(cfg).open(cfg, loaded, POINTS, Run(0, 1, "cpu"))
        vision = loaded.model.config
        grid = (vision.image_size // vision.patch_size) ** 2
        assert grid == 16 and source.item_tokens() == tokens, case
        # and --max-tokens holds whole pictures of that many tokens, also streamed (the model on meta)
        cut = tmp_path / f"{case}-cut"
        config = {**config, "out": str(cut), "max_memory": "9MB", "max_tokens": 3 * tokens + 2}
        extract(ExtractConfig(**config))
        assert len(open_store(cut)) == 3 * tokens


def test_a_chunk_of_pictures_holds_what_the_limit_leaves(saved, data, tmp_path):
    """The hidden states a streamed chunk holds, measured by a forward hook on block 0 (its outputs
    kept for block 1, and block 1's beside them), fit in what the weights leave of the limit. Sized
    as one token a picture (as before), a chunk took all five batches: 2.5x the room."""
    from hookscope.extract.streamed import Streamed

    case, tokens, d_model = "dinov2_with_registers", 21, family_models.D_MODEL
    per_batch = 2 * tokens * d_model * (2 * 8 + len(POINTS) * 4)  # in + out (float64), kept rows (float32)
    cfg = ExtractConfig(**fields(case, saved(case), data, tmp_path / "s"))
    loaded = hs.load(cfg.model, device="meta", tokenizer=False)
    run = Run(0, 1, "cpu")
    source = source_for(cfg).open(cfg, loaded, POINTS, run)
    weights = plan_stream(
        loaded.model, loaded.arch, POINTS, 10**12, batch_size=2, context=tokens, store_itemsize=4
    ).weight_limit
    room = int(2.5 * per_batch)
    cfg = ExtractConfig(**{**fields(case, saved(case), data, tmp_path / "s"), "max_memory": weights + room})
    executor = Streamed(source, loaded, POINTS, torch.float32, run, cfg)
    chunks: list[list[int]] = []  # per chunk, the bytes of each output of block 0
    on_stage = lambda where: chunks.append([]) if where.startswith("block 1/") else None
    loaded.model.get_submodule("encoder.layer.0").register_forward_hook(
        lambda m, a, out: chunks[-1].append((out[0] if isinstance(out, tuple) else out).nbytes)
    )
    ran = executor.run(enumerate(source.batches()), on_stage=on_stage)
    rows = sum(len(r[1]["doc_ids"]) for *_, r in ran)
    assert rows == PICTURES * tokens and len(chunks) > 1
    assert max(2 * sum(chunk) for chunk in chunks) <= room


@pytest.fixture(scope="module")
def server() -> ForkServer:
    return ForkServer.shared()


RUN = "kill_driver:run_extract"
# where a SIGKILL lands: a forward of the first chunk's early blocks, one in the middle of the run
# (inside a chunk), and as the first batch of a chunk goes to the writer (between two chunks)
MOMENTS = {"early": "forward:0.05", "mid-chunk": "forward:0.5", "between chunks": "batch:next"}
KINDS = {
    "encoder": "bert",
    "mixture of experts": "qwen2_moe",
    "vision": "dinov2_with_registers",
    "state space": "rwkv_rescaled",
}  # a decoder: test_stream.py (GPT-2)
# the kind that runs every moment by default: pictures, whose source makes other batches (text's
# source runs every moment in test_stream.py, on GPT-2); the others run the mid-chunk kill by default
# and the rest with --full (where a kill lands in the loop does not depend on the family; each family's
# streamed blocks are the byte-for-byte test's)
EVERY_MOMENT = ("vision",)


def _kills() -> list:
    return [
        pytest.param(
            kind,
            moment,
            id=f"{kind}-{moment}",
            marks=() if kind in EVERY_MOMENT or moment == "mid-chunk" else (pytest.mark.full,),
        )
        for kind in KINDS
        for moment in MOMENTS
    ]


@pytest.fixture(scope="module")
def killed_references(saved, data, server, tmp_path_factory):
    """kind -> (its streamed run's config, the uninterrupted store, its events counted), on first use."""
    made: dict[str, tuple[dict[str, Any], Path, dict[str, int]]] = {}

    def reference(kind: str):
        if kind not in made:
            case = KINDS[kind]
            out = tmp_path_factory.mktemp(f"killed-{case}") / "ref"
            config = fields(case, saved(case), data, out, shard_rows=40)
            server.warm("faultkit:load_model", path=config["model"], tokenizer=not is_vision(case))
            config["max_memory"] = limit_for(config)
            run = server.call(RUN, config=config, kill_at="count")
            assert run.status == 0, run.log[-3000:]
            made[kind] = config, out, run.result["counts"]
        return made[kind]

    return reference


@pytest.mark.parametrize(("kind", "moment"), _kills())
@pytest.mark.slow
def test_a_kill_at_three_moments_resumes_byte_identically(kind, moment, killed_references, server, tmp_path):
    config, reference, counts = killed_references(kind)
    site, at = MOMENTS[moment].split(":")
    # chunks of two: 1-2 (checked before the store opens), 3-4, ...: the second chunk's first
    n = 3 if at == "next" else max(1, int(float(at) * counts[site]))
    out = str(tmp_path / "store")
    killed = server.call(RUN, config={**config, "out": out}, kill_at=f"{site}:{n}")
    assert killed.status == -9, killed.log[-3000:]
    resumed = server.call(RUN, config={**config, "out": out})
    assert resumed.status == 0, resumed.log[-3000:]
    diff = compare_stores(Path(out), reference)
    assert diff == {**diff, **SAME}


@pytest.mark.slow
def test_two_torchrun_ranks_stream_the_shards_two_in_memory_ranks_write(tiny_dirs, data, server, tmp_path):
    """The same two ranks, once streamed: each rank's shards and the merged manifest, byte for byte.
    The ranks are fork-server children with torchrun's environment (tests/kit/elastic_kit.py)."""

    def run(out: Path, *flags: str) -> None:
        cli = [
            "extract",
            str(tiny_dirs["gpt2"]),
            "--out",
            str(out),
            "--points",
            ",".join(POINTS),
            "--data",
            data["text"],
            "--context",
            "16",
            "--batch-size",
            "4",
            "--shard-rows",
            "100",
            "--no-progress",
            *flags,
        ]
        run_ranks(server, 2, cli)

    run(tmp_path / "memory")
    run(tmp_path / "streamed", "--max-memory", "1MB")
    diff = compare_stores(tmp_path / "streamed", tmp_path / "memory")
    assert diff == {**diff, **SAME}
    store = open_store(tmp_path / "streamed")
    assert store.manifest.world_size == 2 and {s.rank for s in store.manifest.shards} == {0, 1}
