"""`hookscope extract --stack`: each glob of the points stored as one column `[rows, blocks, d]`.

References: Hugging Face's `output_hidden_states` for the rows (block l's `resid_post` is hidden
state l + 1, before the final norm), the same extraction without `--stack` for every block and
read (its rows held to their own references elsewhere), and each row's (sequence, position) for
the alignment of a shuffled read. A stack in the wrong block order, a block from another row, or
the two stacks of a CLT read in two orders fails here."""

from __future__ import annotations

import pytest
import torch
from elastic_kit import run_ranks
from forkserver import ForkServer
from helpers import corpus_fixture

import hookscope as hs
from hookscope.cli import main
from hookscope.errors import HookscopeError, StoreError
from hookscope.extract import ExtractConfig, extract
from hookscope.testing import save_tiny

LAYERS = 3
STACKS = ["blocks.*.resid_post", "blocks.*.mlp.in", "blocks.*.mlp.out"]
corpus = corpus_fixture(40)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny("gpt2", tmp_path_factory.mktemp("stack") / "gpt2", d_model=16, n_layers=LAYERS)


def config(model_dir, corpus, out, **kw) -> ExtractConfig:
    return ExtractConfig(
        **{
            "out": str(out),
            "model": str(model_dir),
            "points": [*STACKS, "embed"],
            "data": str(corpus),
            "context": 16,
            "batch_size": 4,
            "dtype": "float32",
            "max_tokens": 16 * 4 * 5,
            "shard_rows": 96,
            "drop_bos": False,
            "progress": False,
            **kw,
        }
    )


@pytest.fixture(scope="module")
def stores(model_dir, corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("stores")
    extract(config(model_dir, corpus, root / "stacked", stack=True))
    extract(config(model_dir, corpus, root / "plain"))
    return hs.open_store(root / "stacked"), hs.open_store(root / "plain")


def test_each_glob_is_one_column_of_every_block_in_order(stores):
    stacked, plain = stores
    assert sorted(stacked.manifest.points) == sorted([*STACKS, "embed"])
    for glob in STACKS:
        column = stacked.tensor(glob)
        assert column.shape == (len(plain), LAYERS, 16)
        for layer in range(LAYERS):
            assert torch.equal(column[:, layer], plain.tensor(glob.replace("*", str(layer))))
    assert torch.equal(stacked.tensor("embed"), plain.tensor("embed"))  # a plain point stays a column
    in_order = [f"blocks.{i}.mlp.in" for i in range(LAYERS)]
    assert stacked.manifest.settings["stacked"]["blocks.*.mlp.in"] == in_order


def test_the_stacked_rows_are_the_models_hidden_states(stores, model_dir):
    stacked, _ = stores
    rows = stacked.rows(0, 64, ["token_ids", "seq_ids", "blocks.*.resid_post"])
    first = rows["seq_ids"] == rows["seq_ids"][0]
    ids = rows["token_ids"][first]
    assert len(ids) == 16  # drop_bos=False: the whole packed sequence is stored
    model = hs.load(str(model_dir)).model
    with torch.no_grad():
        hidden = model(input_ids=ids[None], output_hidden_states=True).hidden_states
    for layer in range(LAYERS - 1):  # the last hidden state is after the final norm
        torch.testing.assert_close(
            rows["blocks.*.resid_post"][first][:, layer], hidden[layer + 1][0], rtol=1e-5, atol=1e-5
        )


def test_a_stored_stack_reads_as_the_stacked_read_of_the_plain_store(stores):
    stacked, plain = stores
    got = list(stacked.dataset("blocks.*.resid_post", batch_size=32, shuffle=False))
    want = list(plain.dataset("blocks.*.resid_post", batch_size=32, shuffle=False, stack=True))
    assert len(got) == len(want) > 2
    for g, w in zip(got, want, strict=True):
        assert g.shape == (32, LAYERS, 16) and torch.equal(g, w)
    ds = stacked.dataset("blocks.*.resid_post", batch_size=32, shuffle=False, stack=True)
    assert torch.equal(next(iter(ds)), got[0])  # already stacked: not stacked again
    assert ds.stacked == {"blocks.*.resid_post": [f"blocks.{i}.resid_post" for i in range(LAYERS)]}


def test_a_clts_two_stored_stacks_share_one_shuffle_order(stores):
    """Each batch row's MLP outputs, at every block, are those of the plain store's row whose MLP
    inputs it has (rows with equal inputs, the same tokens in the same context, have equal outputs)."""
    stacked, plain = stores
    ins = torch.stack([plain.tensor(f"blocks.{i}.mlp.in") for i in range(LAYERS)], dim=1)
    outs = torch.stack([plain.tensor(f"blocks.{i}.mlp.out") for i in range(LAYERS)], dim=1)
    left: dict[bytes, list[int]] = {}
    for i, row in enumerate(ins):
        left.setdefault(row.numpy().tobytes(), []).append(i)
    order = []
    for batch in stacked.dataset(["blocks.*.mlp.in", "blocks.*.mlp.out"], batch_size=24, seed=3, stack=True):
        for row_in, row_out in zip(batch["blocks.*.mlp.in"], batch["blocks.*.mlp.out"], strict=True):
            i = left[row_in.numpy().tobytes()].pop()
            assert torch.equal(row_out, outs[i])
            order.append(i)
    assert not any(left.values()) and sorted(order) == list(range(len(plain)))  # every row once
    assert order != sorted(order)  # shuffled


def test_a_cpu_capture_writes_each_point_into_its_slot_and_a_streamed_run_copies(
    model_dir, corpus, tmp_path, monkeypatch, stores
):
    """In memory on the CPU, no copy makes the stack (each point was written into its slot of the
    column); a streamed run (`--max-memory`, no slots) stacks by a copy, and stores the same rows."""
    from hookscope.extract import stacking

    copies = []
    real = stacking._copied
    monkeypatch.setattr(stacking, "_copied", lambda parts: copies.append(len(parts)) or real(parts))
    extract(config(model_dir, corpus, tmp_path / "slots", stack=True))
    assert copies == []
    extract(config(model_dir, corpus, tmp_path / "streamed", stack=True, max_memory="50MB"))
    assert copies and set(copies) == {LAYERS}
    stacked, _ = stores
    for glob in STACKS:
        assert torch.equal(hs.open_store(tmp_path / "slots").tensor(glob), stacked.tensor(glob))
        torch.testing.assert_close(
            hs.open_store(tmp_path / "streamed").tensor(glob), stacked.tensor(glob), rtol=1e-5, atol=1e-5
        )


def test_a_block_read_alone_says_which_column_holds_it(stores):
    stacked, _ = stores
    with pytest.raises(
        StoreError,
        match=r"blocks\.2\.mlp\.out is stored inside the stacked column "
        r"'blocks\.\*\.mlp\.out'.*index its second dimension",
    ):
        stacked.dataset("blocks.2.mlp.out")


def test_the_statistics_of_a_stack_are_each_blocks_own(stores):
    stacked, plain = stores
    """Per dimension of `[layers, d]`; a layer's mean squared norm from them, as the docs say."""
    st = stacked.stats["blocks.*.resid_post"]
    mean, squares = st.mean.reshape(LAYERS, 16), (st.var + st.mean**2).reshape(LAYERS, 16)
    for layer, one in enumerate(plain.stats[f"blocks.{i}.resid_post"] for i in range(LAYERS)):
        torch.testing.assert_close(mean[layer], one.mean, rtol=1e-9, atol=1e-9)
        # (the stored norms are summed from float32 row norms: agreement to float32 precision)
        assert squares[layer].sum().item() == pytest.approx(one.mean_squared_norm, rel=1e-6)


def test_resuming_needs_the_same_stack(stores, model_dir, corpus):
    stacked, _ = stores
    again = extract(config(model_dir, corpus, stacked.path, stack=True))
    assert again.new_rows == 0 and again.rows == len(stacked) and again.batches_skipped == 5  # nothing to do
    with pytest.raises(StoreError, match=r"different settings(.|\n)*stacked"):
        extract(config(model_dir, corpus, stacked.path))


@pytest.mark.parametrize(
    "points, message",
    [
        (["blocks.1.resid_post"], r"--stack stores each glob of --points as one column.*has no glob"),
        (["blocks.*.resid_post", "blocks.1.*"], r"blocks\.1\.resid_post is matched by both"),
    ],
)
def test_a_stack_that_cannot_be_made_is_refused_before_anything_is_written(
    model_dir, corpus, tmp_path, points, message
):
    with pytest.raises(HookscopeError, match=message):
        extract(config(model_dir, corpus, tmp_path / "out", points=points, stack=True))
    assert not (tmp_path / "out").exists()


def test_the_command_stacks_a_clts_points_in_one_pass(model_dir, corpus, tmp_path, capsys):
    out = tmp_path / "clt"
    assert (
        main(
            [
                "extract",
                str(model_dir),
                "--data",
                str(corpus),
                "--out",
                str(out),
                "--stack",
                "--points",
                "blocks.*.mlp.in,blocks.*.mlp.out",
                "--context",
                "16",
                "--max-tokens",
                "128",
                "--no-progress",
            ]
        )
        == 0
    )
    store = hs.open_store(out)
    assert {k: tuple(v.shape) for k, v in store.manifest.columns.items() if k.startswith("blocks")} == {
        "blocks.*.mlp.in": (LAYERS, 16),
        "blocks.*.mlp.out": (LAYERS, 16),
    }
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    assert f"blocks.*.mlp.out: [{LAYERS}, 16]" in shown
    last = LAYERS - 1
    assert f"stacked: [:, 0] is blocks.0.mlp.out, ..., [:, {last}] is blocks.{last}.mlp.out" in shown


def test_a_stacked_column_is_not_exported_as_one_saelens_hook(stores, tmp_path):
    from hookscope.export import export_saelens

    stacked, _ = stores
    with pytest.raises(StoreError, match=r"'blocks\.\*\.mlp\.in' is a stacked column \(--stack\) of 3"):
        export_saelens(stacked, tmp_path / "cache", point="blocks.*.mlp.in")
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_two_torchrun_ranks_write_the_same_stacked_rows(stores, model_dir, corpus, tmp_path):
    """Two ranks (fork-server children with torchrun's environment: tests/kit/elastic_kit.py)."""
    stacked, _ = stores
    out = tmp_path / "two"
    server = ForkServer.shared()
    cli = [
        "extract",
        str(model_dir),
        "--out",
        str(out),
        "--points",
        ",".join([*STACKS, "embed"]),
        "--stack",
        "--data",
        str(corpus),
        "--context",
        "16",
        "--batch-size",
        "4",
        "--dtype",
        "float32",
        "--max-tokens",
        str(16 * 4 * 5),
        "--shard-rows",
        "96",
        "--keep-bos",
        "--no-progress",
    ]
    run_ranks(server, 2, cli)
    two = hs.open_store(out, verify=True)
    assert two.manifest.world_size == 2
    assert two.manifest.settings["stacked"] == stacked.manifest.settings["stacked"]

    def rows(store, column):
        key = torch.stack([store.tensor("seq_ids"), store.tensor("doc_ids"), store.tensor("positions")], 1)
        order = sorted(range(len(key)), key=lambda i: tuple(key[i].tolist()))
        return key[order], store.tensor(column)[order]

    for glob in STACKS:
        (k2, v2), (k1, v1) = rows(two, glob), rows(stacked, glob)
        assert torch.equal(k2, k1) and torch.equal(v2, v1)
