"""A transcoder trained by a real trainer from a tiny model's store, no glue: sparsify's transcoder
mode (`TranscoderConfig`: encode the MLP's input, decode its output) fed one layer's
`[mlp.in, mlp.out]` pair straight from `store.dataset([...])`, on a tiny BERT; the pair is checked
first against forward hooks on the MLP's own modules (the reference).

SAELens 6.54 has transcoder classes (`sae_lens.saes.transcoder`) for inference only: its
`TrainStepInput` carries `sae_in` and no target, so its trainer cannot train one. No crosscoder or
cross-layer transcoder trainer installs here (dictionary-learning 0.1.0, the only version on the
index, has no `CrossCoder`); `tests/store/test_dataset_stack.py` covers the `[batch, layers, d]` reads such
trainers take.
"""

from __future__ import annotations

from itertools import islice

import pytest
import torch
from gate import need

sparsify = need("sparsify")

import hookscope as hs  # noqa: E402
from hookscope.extract import ExtractConfig, extract  # noqa: E402
from hookscope.testing import save_tiny  # noqa: E402

LAYER = 1
IN, OUT = f"blocks.{LAYER}.mlp.in", f"blocks.{LAYER}.mlp.out"


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("transcoder")
    model = save_tiny("bert", root / "bert", d_model=32, n_layers=2)
    extract(
        ExtractConfig(
            model=str(model),
            out=str(root / "store"),
            points=[IN, OUT],
            max_tokens=4096,
            context=32,
            dtype="float32",
            shard_rows=1024,
            progress=False,
        )
    )
    return model, hs.open_store(root / "store")


def test_the_pair_is_the_mlps_input_and_output(tiny_store):
    """The reference: hooks on the HF BERT layer's `intermediate` (the MLP's first module: its input)
    and `output.dense` (its output before the residual add and LayerNorm)."""
    from transformers import AutoModel, AutoTokenizer

    path, store = tiny_store
    model, tok = AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    layer = model.encoder.layer[LAYER]
    seen = {}
    layer.intermediate.register_forward_hook(lambda m, args, out: seen.update({"in": args[0]}))
    layer.output.dense.register_forward_hook(lambda m, args, out: seen.update({"out": out}))
    rows = store.rows(0, 64, ["token_ids", "seq_ids", "positions", IN, OUT])
    assert store.manifest.settings["drop_bos"]  # each sequence is [CLS] + its 31 stored tokens
    first = rows["seq_ids"] == rows["seq_ids"][0]  # the store's first sequence
    ids = torch.cat([torch.tensor([tok.cls_token_id]), rows["token_ids"][first]])
    assert len(ids) == 32
    with torch.no_grad():
        model(input_ids=ids[None], attention_mask=torch.ones(1, 32, dtype=torch.long))
    torch.testing.assert_close(rows[IN][first], seen["in"][0, 1:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows[OUT][first], seen["out"][0, 1:], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_sparsify_trains_a_transcoder_from_the_store(tiny_store, tmp_path):
    _, store = tiny_store
    x, y = store.tensor(IN), store.tensor(OUT)
    torch.manual_seed(0)
    coder = sparsify.SparseCoder(32, sparsify.TranscoderConfig(num_latents=256, k=16))
    assert coder.cfg.transcode
    opt = torch.optim.Adam(coder.parameters(), lr=2e-3)

    def fvu() -> float:
        with torch.no_grad():
            return float(coder(x, y).fvu)

    before = fvu()
    data = store.dataset([IN, OUT], batch_size=128, drop_last=True, repeat=True)
    losses = []
    for batch in islice(iter(data), 300):
        out = coder(batch[IN], batch[OUT])  # encode the MLP's input, reconstruct its output
        out.fvu.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.fvu))
    after = fvu()
    assert after < 0.5 * before, (before, after)
    assert sum(losses[-20:]) < 0.5 * sum(losses[:20])  # the training loss falls too
    coder.save_to_disk(tmp_path / "tc")  # sparsify's own format, read back by sparsify
    loaded = sparsify.SparseCoder.load_from_disk(tmp_path / "tc")
    assert loaded.cfg.transcode and torch.equal(loaded(x[:64], y[:64]).sae_out, coder(x[:64], y[:64]).sae_out)
