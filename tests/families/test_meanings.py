"""A point whose name changed meaning (Gemma 2's `blocks.1.mlp.out`: the MLP's output before its
post-norm until TransformerLens's meaning, after it, was adopted) is recorded in a store's
settings; a store written before the change is refused on resume with a message saying which point,
what it holds, what the name means now and what to do, still opens for reading, and `hookscope
inspect` says which meaning it holds. Stores of unchanged points resume as before.

"Written before" is the settings the earlier code wrote: the same dict without the meaning record
(`point_meanings` patched to add nothing)."""

from __future__ import annotations

import family_models
import pytest
import torch
from helpers import corpus_fixture

import hookscope as hs
from hookscope.cli import main
from hookscope.extract import ExtractConfig, extract
from hookscope.sources import text
from hookscope.store import open_store

corpus = corpus_fixture(30)
CHANGED = "blocks.1.mlp.out"


@pytest.fixture(scope="module")
def gemma2(gemma2_dir) -> str:
    return gemma2_dir


def config(model: str, corpus, out, points: list[str], max_tokens: int) -> ExtractConfig:
    return ExtractConfig(
        out=str(out),
        model=model,
        points=points,
        data=str(corpus),
        context=16,
        batch_size=2,
        dtype="float32",
        shard_rows=40,
        max_tokens=max_tokens,
        progress=False,
    )


def written_before(monkeypatch, cfg: ExtractConfig) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(text, "point_meanings", lambda loaded, points: {})
        extract(cfg)


def test_a_store_of_a_changed_point_written_before_is_refused_and_still_reads(
    gemma2, corpus, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "old"
    written_before(monkeypatch, config(gemma2, corpus, out, [CHANGED, "blocks.1.resid_post"], 60))
    rows = len(open_store(out))
    with pytest.raises(hs.StoreError) as refused:
        extract(config(gemma2, corpus, out, [CHANGED, "blocks.1.resid_post"], 200))
    said = str(refused.value)
    assert "changed meaning" in said and CHANGED in said and "resid_post" not in said
    assert "this store holds the MLP's output before its post-norm" in said
    assert "now writes what the MLP adds to the residual stream, after its post-norm" in said
    assert "opens for reading" in said and "new --out directory" in said
    store = open_store(out, verify=True)  # untouched, and it reads
    assert len(store) == rows
    assert store[rows - 1][CHANGED].shape == (family_models.D_MODEL,)
    assert main(["inspect", str(out), "--no-verify"]) == 0
    shown = capsys.readouterr().out
    assert "meaning: the MLP's output before its post-norm" in shown and "written before" in shown


def test_a_new_store_records_the_meaning_and_resumes(gemma2, corpus, tmp_path, capsys):
    out = tmp_path / "new"
    extract(config(gemma2, corpus, out, [CHANGED, "blocks.1.mlp.in"], 60))
    record = open_store(out).manifest.settings["point_meanings"]
    assert list(record) == [CHANGED] and "after its post-norm" in record[CHANGED]["means"]
    summary = extract(config(gemma2, corpus, out, [CHANGED, "blocks.1.mlp.in"], 200))
    assert summary.batches_skipped > 0
    assert main(["inspect", str(out), "--no-verify"]) == 0
    assert "meaning: what the MLP adds to the residual stream, after its post-norm" in capsys.readouterr().out


def test_a_stacked_column_of_a_changed_point_shows_its_meaning(gemma2, corpus, tmp_path, capsys):
    out = tmp_path / "stacked"
    cfg = config(gemma2, corpus, out, ["blocks.*.mlp.out"], 60)
    cfg.stack = True
    extract(cfg)
    assert CHANGED in open_store(out).manifest.settings["point_meanings"]
    assert main(["inspect", str(out), "--no-verify"]) == 0
    shown = capsys.readouterr().out
    assert "blocks.*.mlp.out: [" in shown
    assert "meaning: what the MLP adds to the residual stream, after its post-norm" in shown


def test_a_store_of_unchanged_points_resumes_as_before(gemma2, corpus, tmp_path, monkeypatch):
    out = tmp_path / "unchanged"
    points = ["blocks.0.resid_post", "blocks.1.mlp.post"]
    written_before(monkeypatch, config(gemma2, corpus, out, points, 60))
    assert "point_meanings" not in open_store(out).manifest.settings
    summary = extract(config(gemma2, corpus, out, points, 200))
    assert summary.batches_skipped > 0


# DINOv2 (issue 35): attn.out / mlp.out became what is added to the stream, after LayerScale


@pytest.fixture(scope="module")
def dinov2(tmp_path_factory) -> str:
    from hookscope.testing import save_tiny

    # LayerScale 0.5, not 1: before and after the scale differ
    return str(
        save_tiny("dinov2", tmp_path_factory.mktemp("dinov2"), n_layers=2, d_model=32, layerscale_value=0.5)
    )


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    from PIL import Image

    folder = tmp_path_factory.mktemp("pictures")
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        pixels = torch.randint(0, 256, (40, 40, 3), generator=g, dtype=torch.uint8)
        Image.fromarray(pixels.numpy()).save(folder / f"pic{i}.png")
    return folder


def image_config(model: str, folder, out, points: list[str], images: int) -> ExtractConfig:
    tokens = 1 + 16  # CLS and 4x4 patches a picture
    return ExtractConfig(
        out=str(out),
        model=model,
        points=points,
        data=f"images:{folder}",
        batch_size=2,
        dtype="float32",
        max_tokens=images * tokens,
        progress=False,
    )


def test_a_dinov2_store_of_attn_out_before_layerscale_is_refused(
    dinov2, pictures, tmp_path, monkeypatch, capsys
):
    from hookscope.sources import images

    out, points = tmp_path / "old", ["blocks.1.attn.out", "blocks.1.resid_post"]
    with monkeypatch.context() as patch:
        patch.setattr(images, "point_meanings", lambda loaded, points: {})
        extract(image_config(dinov2, pictures, out, points, 2))
    with pytest.raises(hs.StoreError) as refused:
        extract(image_config(dinov2, pictures, out, points, 4))
    said = str(refused.value)
    assert "blocks.1.attn.out" in said and "resid_post" not in said
    assert "this store holds attention's output before LayerScale (now attn.out_pre_scale)" in said
    assert "now writes what attention adds to the residual stream, after LayerScale" in said
    assert len(open_store(out, verify=True)) == 2 * 17
    assert main(["inspect", str(out), "--no-verify"]) == 0
    assert "meaning: attention's output before LayerScale" in capsys.readouterr().out


def test_a_new_dinov2_store_records_the_meaning_and_resumes(dinov2, pictures, tmp_path):
    out, points = tmp_path / "new", ["blocks.0.mlp.out", "blocks.0.mlp.out_pre_scale"]
    extract(image_config(dinov2, pictures, out, points, 2))
    record = open_store(out).manifest.settings["point_meanings"]
    assert list(record) == ["blocks.0.mlp.out"] and "after LayerScale" in record["blocks.0.mlp.out"]["means"]
    summary = extract(image_config(dinov2, pictures, out, points, 4))
    assert summary.batches_skipped > 0
    store = open_store(out)
    assert len(store) == 4 * 17
    assert not torch.equal(store.tensor("blocks.0.mlp.out"), store.tensor("blocks.0.mlp.out_pre_scale"))
