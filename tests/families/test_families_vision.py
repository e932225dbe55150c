"""Vision encoders (arch/vit.py, clip.py, dinov2.py) on tiny random-init models saved to disk with
their image processor: every point equals a plain register_forward_hook on a module path written
by hand in family_paths.py (never read from the table under test), positions are
CLS + patches, early stop skips later blocks, and `extract --data images:DIR` round-trips rows
traced to their image and patch (hookscope.sources.images)."""

from __future__ import annotations

import pytest
import torch
from family_paths import reference, vision_paths
from PIL import Image

import hookscope as hs
from hookscope.arch import arch_of
from hookscope.errors import DataError
from hookscope.extract import ExtractConfig, extract
from hookscope.sources.images import load_processor
from hookscope.testing import VISION_FAMILIES, save_tiny

GRID = 4  # 32x32 pixels in 8x8 patches
# tokens before the patches: CLS (and DINOv2's 4 default register tokens)
PREFIX = {"vit": 1, "clip_vision_model": 1, "dinov2": 1, "siglip_vision_model": 0, "dinov2_with_registers": 5}


@pytest.fixture(scope="module", params=VISION_FAMILIES)
def vision(request, tmp_path_factory):
    # DINOv2's LayerScale starts at 1 (attn.out would equal attn.out_pre_scale): one that is not
    scale = {"layerscale_value": 0.5} if request.param.startswith("dinov2") else {}
    path = save_tiny(request.param, tmp_path_factory.mktemp(request.param), n_layers=2, d_model=32, **scale)
    model = hs.load(str(path), tokenizer=False, attn_implementation="eager").model
    return request.param, path, model


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    """Five small pictures of different sizes and colours (one in a sub-folder)."""
    folder = tmp_path_factory.mktemp("pictures")
    g = torch.Generator().manual_seed(0)
    (folder / "more").mkdir()
    for i, size in enumerate([(40, 40), (32, 48), (64, 36), (33, 33), (50, 70)]):
        pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
        name = f"more/pic{i}.png" if i == 3 else f"pic{i}.png"
        Image.fromarray(pixels.numpy()).save(folder / name)
    return folder


def _pixels(path, folder, names):
    processor = load_processor(str(path))
    return processor(images=[Image.open(folder / n).convert("RGB") for n in names], return_tensors="pt")[
        "pixel_values"
    ]


def test_every_point_equals_a_forward_hook(vision, image_dir):
    family, path, model = vision
    arch = arch_of(model)
    assert arch.family == family.replace("_vision_model", "")
    pixels = _pixels(path, image_dir, ["pic0.png", "pic1.png"])
    ref = reference(model, vision_paths(model), {"pixel_values": pixels})
    acts = hs.collect(model, {"pixel_values": pixels}, arch.names)
    assert set(acts) == set(ref) == set(arch.names)
    for name, expect in ref.items():
        assert torch.equal(acts[name], expect), name
    tokens = PREFIX[family] + GRID * GRID
    assert acts["blocks.1.resid_post"].shape == (2, tokens, 32)
    assert acts["blocks.0.attn.q"].shape == (2, tokens, 4, 8)  # per head
    assert acts["blocks.1.attn.pattern"].shape == (2, 4, tokens, tokens)
    assert acts["blocks.0.mlp.post"].shape[:2] == (2, tokens)


def test_dinov2_layerscale_outputs_keep_their_earlier_names(vision, image_dir):
    """`attn.scaled` / `mlp.scaled`, the LayerScale outputs' names before they became `attn.out` /
    `mlp.out`, still read them (a plain hook on `layer_scale1` / `layer_scale2`)."""
    family, path, model = vision
    if not family.startswith("dinov2"):
        pytest.skip("LayerScale is DINOv2's")
    pixels = {"pixel_values": _pixels(path, image_dir, ["pic0.png"])}
    got = hs.collect(model, pixels, ["blocks.1.attn.scaled", "blocks.1.mlp.scaled"])
    ref = reference(
        model,
        {
            "a": ("encoder.layer.1.layer_scale1", "output", lambda x: x),
            "m": ("encoder.layer.1.layer_scale2", "output", lambda x: x),
        },
        pixels,
    )
    assert torch.equal(got["blocks.1.attn.scaled"], ref["a"])
    assert torch.equal(got["blocks.1.mlp.scaled"], ref["m"])


def test_positions_are_cls_and_patches(vision, image_dir):
    """positions=0 is the CLS token (the patches' own index otherwise); a list picks patches."""
    family, path, model = vision
    pixels = _pixels(path, image_dir, ["pic2.png"])
    full = hs.collect(model, {"pixel_values": pixels}, "blocks.0.resid_post")["blocks.0.resid_post"]
    first = hs.collect(model, {"pixel_values": pixels}, "blocks.0.resid_post", positions=0)
    assert torch.equal(first["blocks.0.resid_post"], full[:, 0])
    patch_5 = PREFIX[family] + 5
    some = hs.collect(model, {"pixel_values": pixels}, "blocks.0.resid_post", positions=[patch_5])
    assert torch.equal(some["blocks.0.resid_post"], full[:, [patch_5]])


def test_early_stop_skips_later_blocks(vision, image_dir):
    family, path, model = vision
    arch = arch_of(model)
    blocks = [model.get_submodule(p) for p in arch.block_paths]
    calls = [0] * len(blocks)
    handles = [
        b.register_forward_pre_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, b in enumerate(blocks)
    ]
    try:
        hs.collect(model, {"pixel_values": _pixels(path, image_dir, ["pic0.png"])}, "blocks.0.mlp.post")
    finally:
        for h in handles:
            h.remove()
    assert calls == [1, 0]


def test_image_extraction_round_trips_and_traces_rows(vision, image_dir, tmp_path):
    family, path, model = vision
    out = tmp_path / "store"
    cfg = ExtractConfig(
        out=str(out),
        model=str(path),
        points=["blocks.1.resid_post", "blocks.0.mlp.post"],
        data=f"images:{image_dir}",
        batch_size=2,
        dtype="float32",
        progress=False,
    )
    summary = extract(cfg)
    tokens = PREFIX[family] + GRID * GRID
    assert summary.rows == summary.new_rows == 5 * tokens
    store = hs.open_store(out)
    names = store.manifest.settings["images"]
    assert names == ["more/pic3.png", "pic0.png", "pic1.png", "pic2.png", "pic4.png"]
    doc, pos = store.tensor("doc_ids"), store.tensor("positions")
    rows, cols = store.tensor("patch_rows"), store.tensor("patch_cols")
    resid, post = store.tensor("blocks.1.resid_post"), store.tensor("blocks.0.mlp.post")
    # the reference: each image alone through the processor and the model, read by plain hooks
    points = {"blocks.1.resid_post", "blocks.0.mlp.post"}
    for image, name in enumerate(names):
        pixels = {"pixel_values": _pixels(path, image_dir, [name])}
        ref = reference(model, vision_paths(model), pixels, points)
        mine = (doc == image).nonzero().flatten()
        assert len(mine) == tokens
        assert torch.equal(pos[mine], torch.arange(tokens))
        assert torch.allclose(resid[mine], ref["blocks.1.resid_post"][0], atol=1e-5)
        assert torch.allclose(post[mine], ref["blocks.0.mlp.post"][0], atol=1e-5)
        patch = pos[mine] - PREFIX[family]
        expect_rows = torch.where(patch >= 0, patch // GRID, -1)
        expect_cols = torch.where(patch >= 0, patch % GRID, -1)
        assert torch.equal(rows[mine], expect_rows) and torch.equal(cols[mine], expect_cols)
    # the patch at grid (2, 3) of image 4 is the token at PREFIX + 2*4 + 3 of that image
    row = ((doc == 4) & (rows == 2) & (cols == 3)).nonzero().item()
    assert pos[row] == PREFIX[family] + 11
    # run again: every batch is on disk already, nothing is written twice
    again = extract(cfg)
    assert again.new_rows == 0 and again.batches_skipped == 3 and again.rows == 5 * tokens


def test_image_settings_are_those_stores_were_made_with(vision, image_dir, tmp_path):
    """Key for key and in order, as b05e947's images.extract_images wrote them: old image stores
    resume (another hash would refuse them)."""
    import hashlib

    family, path, model = vision
    extract(
        ExtractConfig(
            out=str(tmp_path / "s"),
            model=str(path),
            points=["blocks.0.resid_post"],
            data=f"images:{image_dir}",
            progress=False,
        )
    )
    names = ["more/pic3.png", "pic0.png", "pic1.png", "pic2.png", "pic4.png"]
    files = hashlib.sha256()
    for name in names:
        files.update(name.encode() + b"\0" + hashlib.sha256((image_dir / name).read_bytes()).digest())
    config = hs.load(str(path), tokenizer=False).model.config.to_json_string(use_diff=False)
    processor = load_processor(str(path)).to_json_string()
    want = {
        "model": str(path),
        "model_class": type(model).__name__,
        "config_sha256": hashlib.sha256(config.encode()).hexdigest(),
        "image_processor_sha256": hashlib.sha256(processor.encode()).hexdigest(),
        "points": ["blocks.0.resid_post"],
        "dtype": "float16",
        "batch_size": 8,
        "data": f"images:{image_dir}",
        "images": names,
        "images_sha256": files.hexdigest(),
    }
    assert list(hs.open_store(tmp_path / "s").manifest.settings.items()) == list(want.items())


def test_max_tokens_keeps_whole_images(vision, image_dir, tmp_path):
    """--max-tokens on images (ignored before): the first max_tokens // T images, T tokens each
    (whole images, as text keeps whole sequences); fewer than one image's tokens is refused."""
    family, path, model = vision
    tokens = PREFIX[family] + GRID * GRID
    cfg = ExtractConfig(
        out=str(tmp_path / "s"),
        model=str(path),
        points=["blocks.0.resid_post"],
        data=f"images:{image_dir}",
        batch_size=2,
        dtype="float32",
        progress=False,
        max_tokens=3 * tokens + tokens // 2,
    )
    summary = extract(cfg)
    store = hs.open_store(tmp_path / "s")
    assert summary.rows == len(store) == 3 * tokens
    assert torch.equal(store.tensor("doc_ids"), torch.arange(3).repeat_interleave(tokens))
    with pytest.raises(DataError, match=f"gives {tokens} tokens"):
        extract(ExtractConfig(**{**cfg.__dict__, "out": str(tmp_path / "t"), "max_tokens": tokens - 1}))
    assert not (tmp_path / "t").exists()


def test_image_folder_errors(vision, tmp_path):
    family, path, model = vision
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no image files"):
        extract(
            ExtractConfig(
                out=str(tmp_path / "s"),
                model=str(path),
                points=["blocks.0.resid_post"],
                data=f"images:{tmp_path / 'empty'}",
                progress=False,
            )
        )


def test_cli_points_lists_patches(vision, capsys):
    """`hookscope points` on a vision encoder: shapes from a sample image through its processor."""
    from hookscope.cli import main

    family, path, model = vision
    assert main(["points", str(path), "--pattern", "blocks.1.*"]) == 0
    out = capsys.readouterr().out
    tokens = PREFIX[family] + GRID * GRID
    assert f"family {arch_of(model).family}," in out
    assert "blocks.1.resid_post" in out and f"[1, {tokens}, 32]" in out
    assert f"[1, {tokens}, 4, 8]" in out  # per-head attention


def test_cli_extract_images(vision, image_dir, tmp_path, capsys):
    from hookscope.cli import main

    family, path, model = vision
    out = tmp_path / "acts"
    assert (
        main(
            [
                "extract",
                str(path),
                "--data",
                f"images:{image_dir}",
                "--points",
                "blocks.0.resid_post",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    assert "wrote" in capsys.readouterr().out
    store = hs.open_store(out, verify=True)
    assert len(store) == 5 * (PREFIX[family] + GRID * GRID)
    assert store.points["blocks.0.resid_post"].dtype == "float16"  # the CLI's default dtype


def test_keep_bos_is_refused_for_images(image_dir, tmp_path, capsys):
    """Images keep every token (CLS and registers too: the round-trip test above reads them back),
    so `--keep-bos` has nothing to keep: refused before a store exists, saying what to do."""
    from hookscope.cli import main
    from hookscope.errors import HookscopeError

    path = save_tiny("vit", tmp_path / "vit", n_layers=2, d_model=32)
    out = tmp_path / "acts"
    args = [
        "extract",
        str(path),
        "--data",
        f"images:{image_dir}",
        "--points",
        "blocks.0.resid_post",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main([*args, "--keep-bos"]) == 2
    err = capsys.readouterr().err
    assert "--keep-bos: images always keep every token" in err and "leave --keep-bos out" in err
    assert not out.exists()
    with pytest.raises(HookscopeError, match="patch_rows >= 0"):
        extract(
            ExtractConfig(
                out=str(out),
                model=str(path),
                points=["blocks.0.resid_post"],
                data=f"images:{image_dir}",
                drop_bos=False,
                progress=False,
            )
        )
    assert main(args) == 0  # the corrected command
    assert len(hs.open_store(out, verify=True)) == 5 * (PREFIX["vit"] + GRID * GRID)


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_two_tower_models_name_their_vision_tower(family):
    """CLIPModel / SiglipModel: the points are the vision tower's, under vision_model."""
    from transformers import AutoConfig, AutoModel

    tower = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
    )
    text = dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, vocab_size=99
    )
    torch.manual_seed(0)
    model = AutoModel.from_config(AutoConfig.for_model(family, vision_config=tower, text_config=text)).eval()
    arch = arch_of(model)
    assert arch.family == family and arch.block_paths == [
        "vision_model.encoder.layers.0",
        "vision_model.encoder.layers.1",
    ]
    pixels = torch.randn(2, 3, 32, 32)
    inputs = {"pixel_values": pixels, "input_ids": torch.randint(0, 99, (2, 5))}
    points = ["embed", "blocks.1.attn.z", "blocks.1.resid_post", "ln_final"]
    ref = reference(model, vision_paths(model, prefix="vision_model."), inputs, points)
    acts = hs.collect(model, inputs, points)
    for name in points:
        assert torch.equal(acts[name], ref[name]), name


def test_device_map_gives_the_rows_of_a_plain_run(image_dir, tmp_path, monkeypatch):
    """--device-map on images (ignored before): the model is loaded with it (through accelerate,
    all on the CPU here) and the store holds the same rows, bit for bit, as without it."""
    from hookscope.extract import loop  # the module: `hookscope.extract` is also the function hs.extract

    asked = []
    real_load = loop.load
    monkeypatch.setattr(loop, "load", lambda *a, **k: asked.append(k.get("device_map")) or real_load(*a, **k))
    vit = save_tiny("vit", tmp_path / "vit", n_layers=2, d_model=32)
    stores = {}
    for device_map in (None, "auto"):
        out = tmp_path / f"store-{device_map}"
        extract(
            ExtractConfig(
                out=str(out),
                model=str(vit),
                points=["blocks.1.resid_post"],
                data=f"images:{image_dir}",
                dtype="float32",
                progress=False,
                device_map=device_map,
            )
        )
        stores[device_map] = hs.open_store(out)
    assert asked == [None, "auto"]
    plain, mapped = stores[None], stores["auto"]
    assert len(mapped) == len(plain) == 5 * (PREFIX["vit"] + GRID * GRID)
    for column in plain.manifest.columns:
        assert torch.equal(mapped.tensor(column), plain.tensor(column)), column
