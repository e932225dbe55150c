"""The transcoder's pair from the command line: `hookscope points` says what each name means, and
`hookscope extract --points 'blocks.*.mlp.in,blocks.*.mlp.out'` stores both, every layer, from one
run, equal to plain forward hooks on the Hugging Face modules written here (Gemma 2: the MLP's
input, and the post-feedforward norm's output, what is added to the residual stream)."""

from __future__ import annotations

import family_models
import pytest
import torch
from helpers import corpus_fixture, plain_hooks
from transformers import AutoModelForCausalLM

from hookscope.cli import main
from hookscope.store import open_store

corpus = corpus_fixture(30)


@pytest.fixture(scope="module")
def gemma2(gemma2_dir) -> str:
    return gemma2_dir


def test_points_says_what_names_mean(gemma2, capsys):
    assert main(["points", gemma2, "--pattern", "blocks.1.*"]) == 0
    out = capsys.readouterr().out.splitlines()
    lines = {line.split()[0]: line for line in out if line.startswith("  blocks.")}
    assert "what the MLP reads (after ln2)" in lines["blocks.1.mlp.in"]
    assert "what the MLP adds to the residual stream" in lines["blocks.1.mlp.out"]
    assert "post_feedforward_layernorm:output" in lines["blocks.1.mlp.out"]
    assert "MLP output before its post-norm" in lines["blocks.1.mlp.out_pre_norm"]
    assert "ln2's input / scale, before its weight" in lines["blocks.1.ln2.normalized"]


def test_extract_mlp_in_and_out_of_every_layer_in_one_run(gemma2, corpus, tmp_path, capsys):
    out = tmp_path / "store"
    assert (
        main(
            [
                "extract",
                gemma2,
                "--out",
                str(out),
                "--data",
                str(corpus),
                "--context",
                "16",
                "--batch-size",
                "4",
                "--dtype",
                "float32",
                "--keep-bos",
                "--max-tokens",
                "160",
                "--points",
                "blocks.*.mlp.in,blocks.*.mlp.out",
                "--no-progress",
            ]
        )
        == 0
    )
    store = open_store(out, verify=True)
    layers = range(family_models.N_LAYERS)
    names = [f"blocks.{L}.mlp.{s}" for L in layers for s in ("in", "out")]
    assert sorted(store.points) == sorted(names)
    # the reference: each stored sequence again, through a plain model with plain hooks
    model = AutoModelForCausalLM.from_pretrained(gemma2, attn_implementation="eager").eval()
    blocks = model.model.layers
    taps = {f"blocks.{L}.mlp.in": (blocks[L].mlp, "input", lambda x: x) for L in layers}
    taps |= {
        f"blocks.{L}.mlp.out": (blocks[L].post_feedforward_layernorm, "output", lambda x: x) for L in layers
    }
    seq, pos, ids = store.tensor("seq_ids"), store.tensor("positions"), store.tensor("token_ids")
    stored = {name: store.tensor(name) for name in names}
    for s in seq.unique():
        rows = (seq == s).nonzero().flatten()  # a sequence's rows, in token order (--keep-bos: all)
        assert len(rows) <= 16 and pos[rows[0]] == -1  # it opens with the start token
        want = plain_hooks(model, taps, lambda rows=rows: model(ids[rows][None].long()))
        for name in names:
            torch.testing.assert_close(stored[name][rows], want[name][0], atol=1e-5, rtol=1e-5)
    assert len(seq.unique()) >= 5
