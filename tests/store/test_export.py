"""A store exported as a `datasets` folder (one row per token) and as SAELens's cached-activations
layout (one example per sequence), checked against the store's own rows; the CLI; and a store
directory that `datasets.load_dataset` refuses instead of misreading.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch
from gate import need
from helpers import tiny_hooked_transformer

from hookscope.cli import main as cli
from hookscope.errors import StoreError
from hookscope.export import SIDECAR, export_hf, export_saelens, saelens_config, tl_hook_name
from hookscope.names import canonical
from hookscope.store import ShardWriter, open_store
from hookscope.store.card import NOT_A_DATASET

RESID, Z = "blocks.0.resid_post", "blocks.0.attn.z"


def make_store(
    out: Path,
    *,
    seq_len: int,
    context: int,
    n_seqs: int = 12,
    per_batch: int = 2,
    shard_rows: int = 20,
    seed: int = 0,
):
    """n_seqs sequences of seq_len rows (bfloat16 vectors, float16 per-head values), written as
    batches of `per_batch` sequences; token_ids count rows, seq_ids name each row's sequence."""
    g = torch.Generator().manual_seed(seed)
    settings = {"model": "tiny/model", "context": context, "points": [RESID, Z], "dtype": "mixed"}
    with ShardWriter(out, settings, shard_rows=shard_rows) as w:
        for b in range(n_seqs // per_batch):
            rows = per_batch * seq_len
            start = b * rows
            w.write(
                b,
                {
                    RESID: torch.randn(rows, 6, generator=g).to(torch.bfloat16),
                    Z: torch.randn(rows, 2, 3, generator=g).half(),
                },
                {
                    "token_ids": torch.arange(start, start + rows),
                    "seq_ids": torch.arange(b * per_batch, (b + 1) * per_batch).repeat_interleave(seq_len),
                },
            )
    return open_store(out)


def stored_values(ds, column: str) -> torch.Tensor:
    """The values of `column` as the Arrow file holds them (dtype included), flattened."""
    array = ds.data.column(column).combine_chunks()
    array = getattr(array, "storage", array)
    while hasattr(array, "flatten"):
        array = array.flatten()
    return torch.from_numpy(array.to_numpy(zero_copy_only=False).copy())


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """Every sequence kept all its tokens (drop_bos=False): 12 sequences of 8 rows, context 8."""
    return make_store(tmp_path_factory.mktemp("whole") / "s", seq_len=8, context=8)


@pytest.fixture(scope="module")
def ragged(tmp_path_factory):
    """Special tokens dropped: 7 rows kept per sequence of context 8 (84 rows)."""
    return make_store(tmp_path_factory.mktemp("ragged") / "s", seq_len=7, context=8)


def test_hf_export_keeps_shapes_dtypes_settings_and_rows(whole, tmp_path, monkeypatch):
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    out = export_hf(whole, tmp_path / "hf", progress=False)
    ds = datasets.load_from_disk(str(out))
    assert ds.num_rows == len(whole) == 96
    f = ds.features
    # fixed shapes, not variable-length lists; float16 kept; bfloat16 widened to float32 (exactly)
    assert f[RESID] == datasets.List(datasets.Value("float32"), length=6)
    assert f[Z] == datasets.Array2D(shape=(2, 3), dtype="float16")
    assert f["token_ids"] == datasets.Value("int64")
    ds.set_format("torch")
    assert torch.equal(ds[RESID][:], whole.tensor(RESID).float())
    assert torch.equal(ds[Z][:], whole.tensor(Z).float())
    # the formatters hand out float32; the file holds float16 (Arrow's halffloat)
    assert torch.equal(stored_values(ds, Z).reshape(96, 2, 3), whole.tensor(Z))
    assert ds["token_ids"][:].tolist() == list(range(96))
    # the store's settings travel with the dataset
    assert json.dumps(whole.manifest.settings, sort_keys=True) in ds.info.description
    meta = json.loads((out / SIDECAR).read_text())
    assert meta["store"]["settings"] == whole.manifest.settings
    assert meta["store"]["settings_hash"] == whole.manifest.settings_hash
    assert meta["columns"][RESID] == {"shape": [6], "store_dtype": "bfloat16", "dtype": "float32"}
    # one write: one Arrow file per shard, nothing in the datasets cache, no leftover partial folder
    assert sorted(p.name for p in out.glob("*.arrow")) == [
        f"data-{i:05d}-of-{whole.num_shards:05d}.arrow" for i in range(whole.num_shards)
    ]
    data_bytes = 96 * (6 * 4 + 6 * 2 + 8 + 8)
    assert data_bytes <= sum(p.stat().st_size for p in out.glob("*.arrow")) < 1.5 * data_bytes + 20_000
    assert not cache.exists() or not any(cache.rglob("*.arrow"))
    assert not (tmp_path / "hf.partial").exists()


def test_hf_export_refuses_to_overwrite_and_leaves_nothing_half_written(whole, tmp_path, monkeypatch):
    out = tmp_path / "hf"
    export_hf(whole, out, [RESID], progress=False)
    with pytest.raises(StoreError, match="already exists"):
        export_hf(whole, out, progress=False)
    with pytest.raises(StoreError, match="no column 'nope'"):
        export_hf(whole, tmp_path / "other", ["nope"], progress=False)

    import hookscope.export.hf as hf

    calls = []

    def failing(values, feat):  # the disk fills up on the third shard
        calls.append(1)
        if len(calls) == 3:
            raise OSError("No space left on device")
        return real(values, feat)

    real = hf.arrow_column
    monkeypatch.setattr(hf, "arrow_column", failing)
    with pytest.raises(OSError, match="No space"):
        export_hf(whole, tmp_path / "crash", [RESID], progress=False)
    assert not (tmp_path / "crash").exists() and not (tmp_path / "crash.partial").exists()
    # overwrite=True replaces a finished export
    monkeypatch.undo()
    export_hf(whole, out, [Z], overwrite=True, progress=False)
    assert datasets.load_from_disk(str(out)).column_names == [Z]


def test_saelens_layout_of_whole_sequences(whole, tmp_path):
    done = export_saelens(whole, tmp_path / "sl", RESID, progress=False)
    assert (done.hook_name, done.context_size, done.d_in, done.dtype, done.sequences) == (
        "blocks.0.hook_resid_post",
        8,
        6,
        "float32",
        "whole",
    )
    assert (done.examples, done.rows_exported, done.rows_left_out) == (12, 96, 0)
    assert done.model_name == "tiny/model"
    ds = datasets.load_from_disk(done.path)
    assert ds.features["blocks.0.hook_resid_post"] == datasets.Array2D(shape=(8, 6), dtype="float32")
    assert ds.features["token_ids"] == datasets.List(datasets.Value("int32"), length=8)
    ds.set_format("torch")
    acts, tokens = ds["blocks.0.hook_resid_post"][:], ds["token_ids"][:]
    # example i is sequence i of the store: its rows, in order
    seq = whole.tensor("seq_ids")
    for i in range(12):
        assert torch.equal(acts[i], whole.tensor(RESID)[seq == i].float())
        assert torch.equal(tokens[i].long(), whole.tensor("token_ids")[seq == i])
    assert saelens_config(done.path) == done


def test_saelens_layout_of_a_per_head_point_and_of_ragged_sequences(ragged, tmp_path):
    done = export_saelens(ragged, tmp_path / "z", Z, progress=False)
    # 84 rows regrouped into examples of the extraction context (8): 10 examples, 4 rows left out
    assert (done.sequences, done.context_size, done.examples, done.rows_left_out) == ("regrouped", 8, 10, 4)
    assert (done.hook_name, done.d_in, done.dtype) == ("blocks.0.attn.hook_z", 6, "float16")
    ds = datasets.load_from_disk(done.path)
    flat = stored_values(ds, "blocks.0.attn.hook_z").reshape(-1, 6)
    assert torch.equal(flat, ragged.tensor(Z)[:80].reshape(80, 6))
    tokens = stored_values(ds, "token_ids")
    assert tokens.dtype == torch.int32 and tokens.tolist() == list(range(80))
    # an explicit context size, and its limits
    assert export_saelens(ragged, tmp_path / "c7", RESID, context_size=7, progress=False).examples == 12
    with pytest.raises(StoreError, match="holds 2 points"):
        export_saelens(ragged, tmp_path / "x", progress=False)
    with pytest.raises(StoreError, match="do not fill one example"):
        export_saelens(ragged, tmp_path / "y", RESID, context_size=1000, progress=False)


@pytest.mark.parametrize(
    "point, tl",
    [
        ("blocks.3.resid_post", "blocks.3.hook_resid_post"),
        ("blocks.3.resid_pre", "blocks.3.hook_resid_pre"),
        ("blocks.0.attn.z", "blocks.0.attn.hook_z"),
        ("blocks.2.attn.out", "blocks.2.hook_attn_out"),
        ("blocks.2.mlp.out", "blocks.2.hook_mlp_out"),
        ("blocks.1.mlp.post", "blocks.1.mlp.hook_post"),
        ("embed", "hook_embed"),
        ("ln_final.normalized", "ln_final.hook_normalized"),
        ("ln_final", "ln_final.hook_out"),  # after the norm's weight: the bridge's HookPoint
        # what the MLP reads (after ln2) is the bridge's mlp.hook_in;
        # TL's hook_mlp_in is the stream before ln2
        ("blocks.1.mlp.in", "blocks.1.mlp.hook_in"),
        ("blocks.1.mlp.in_pre_norm", "blocks.1.hook_mlp_in"),
        ("blocks.1.attn.in", "blocks.1.attn.hook_in"),
        ("blocks.1.attn.in_pre_norm", "blocks.1.hook_attn_in"),
    ],
)
def test_transformer_lens_hook_names(point: str, tl: str):
    assert tl_hook_name(point) == tl
    assert canonical(tl) == point  # hookscope reads TL's spelling back as the same point


def test_tl_hook_names_exist_on_a_hooked_transformer():
    need("tl3")
    model = tiny_hooked_transformer(d_model=16, n_ctx=8, d_vocab=32)
    import hookscope as hs

    # but the final norm's output, which HookedTransformer has no HookPoint for (hookscope hooks the module)
    points = [
        p.name
        for p in hs.points(model)
        if not p.name.startswith("module:") and p.name not in ("logits", "ln_final")
    ]
    assert len(points) > 20
    missing = [p for p in points if tl_hook_name(p) not in model.hook_dict]
    assert missing == []
    with pytest.raises(StoreError, match="hook_name="):
        tl_hook_name("module:transformer.h.0:output")


def test_cli_export(whole, tmp_path, capsys):
    assert (
        cli(
            [
                "export",
                str(whole.path),
                "--format",
                "saelens",
                "--point",
                Z,
                "--out",
                str(tmp_path / "sl"),
                "--no-progress",
            ]
        )
        == 0
    )
    said = capsys.readouterr().out
    assert "12 examples of 8 x 6 float16" in said and "hook_name='blocks.0.attn.hook_z'" in said
    assert datasets.load_from_disk(str(tmp_path / "sl")).num_rows == 12
    assert (
        cli(
            [
                "export",
                str(whole.path),
                "--format",
                "hf",
                "--columns",
                f"{RESID},token_ids",
                "--out",
                str(tmp_path / "hf"),
                "--no-progress",
            ]
        )
        == 0
    )
    assert datasets.load_from_disk(str(tmp_path / "hf")).column_names == [RESID, "token_ids"]
    again = ["export", str(whole.path), "--format", "hf", "--out", str(tmp_path / "hf"), "--no-progress"]
    assert cli(again) == 2
    assert "already exists" in capsys.readouterr().err
    assert (
        cli(["export", str(whole.path), "--format", "hf", "--point", RESID, "--out", str(tmp_path / "h2")])
        == 2
    )
    assert "for --format saelens" in capsys.readouterr().err


def test_load_dataset_on_a_store_directory_fails_and_says_what_it_is(whole):
    assert (Path(whole.path) / "README.md").is_file()
    with pytest.raises(FileNotFoundError) as e:
        datasets.load_dataset(str(whole.path))
    assert NOT_A_DATASET in str(e.value)
    # the card does not get in the store's own way: it still opens and verifies
    open_store(whole.path, verify=True)
