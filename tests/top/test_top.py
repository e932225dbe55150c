"""The top-k index and queries against independent references: plain-Python sorting of every row
(brute-force top-k, ties by row), the tokenization the store was built from, and SAE feature values
computed with the plain SAELens formulas."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from top_fixtures import (
    DEAD,
    PLANTED,
    POINT,
    TIED,
    UNITS,
    brute_force_top,
    expected_window,
    make_store,
)

import hookscope as hs
from hookscope.errors import HookscopeError, StoreError
from hookscope.store import ShardWriter, open_store
from hookscope.top import (
    SAEError,
    StaleIndexError,
    build_index,
    get_index,
    index_path,
    load_encoder,
    load_index,
    neurons,
    top,
)
from hookscope.top.index import HIST_BINS, hist_edges


@pytest.fixture(scope="module")
def syn(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("top"))


@pytest.fixture()
def store(syn):
    return open_store(syn.path)


def _x(store):
    return store.tensor(POINT).float()


@pytest.mark.parametrize("batch_rows", [7, 64, None])
@pytest.mark.parametrize("k", [1, 5, 40])
def test_index_is_exactly_the_brute_force_top_k(store, batch_rows, k):
    x = _x(store)
    want_v, want_r = brute_force_top(x, k)
    index = build_index(store, POINT, k=k, batch_rows=batch_rows)
    assert torch.equal(index.rows, want_r), "rows differ from the brute-force order (value desc, row asc)"
    assert torch.equal(index.values, want_v)
    # the cases this store plants: a tie at the k-th place, and a dead unit where every row ties
    assert (x[:, TIED] == want_v[TIED, -1]).sum() > (want_v[TIED] == want_v[TIED, -1]).sum()
    assert index.rows[DEAD].tolist() == list(range(min(k, len(store))))


def test_histogram_and_frequency_match_a_plain_count(store):
    x = _x(store)
    index = build_index(store, POINT, k=3, batch_rows=50)
    assert torch.equal(index.fires, (x >= 2.0**-15).sum(0))
    edges = torch.tensor(hist_edges())
    assert len(edges) == HIST_BINS + 1
    for u in range(UNITS):
        col = x[:, u].tolist()
        want = [0] * HIST_BINS
        for v in col:  # the documented bins: [2^e, 1.5 2^e), [1.5 2^e, 2^(e+1)) per sign from 2^-10
            a = abs(v)
            if a < 2.0**-10:
                b = 40
            else:
                e = math.floor(math.log2(a))
                j = min(39, 2 * (e + 10) + (a / 2.0**e >= 1.5))
                b = 41 + j if v > 0 else 39 - j
                lo, hi = edges[41 + j].item(), edges[42 + j].item()
                assert lo <= a < hi
            want[b] += 1
        assert index.hist[u].tolist() == want, f"unit {u}"
        assert sum(want) == len(store)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float32_and_bfloat16_stores_with_nan(tmp_path, dtype):
    """The other dtypes take the float32 path; NaN (counted by the writer) never reaches the top."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300, 6, generator=g).to(dtype)
    x[::7, 2] = float("nan")
    x[:, 4] = x[:, 4].round()  # ties
    with ShardWriter(tmp_path / "s", {"t": 1}, shard_rows=64) as w:
        for b in range(0, 300, 20):
            w.write(b // 20, {"p": x[b : b + 20]}, {"token_ids": torch.arange(b, b + 20)})
    store = open_store(tmp_path / "s")
    assert store.stats["p"].nonfinite > 0
    ref = torch.nan_to_num(x.float(), nan=float("-inf"))
    index = build_index(store, "p", k=9, batch_rows=13)
    want_v, want_r = brute_force_top(ref, 9)
    assert torch.equal(index.rows, want_r) and torch.equal(index.values, want_v)
    assert torch.equal(index.fires, (x.float() >= 2.0**-15).sum(0))
    assert index.hist.sum(1).tolist() == [300] * 6


def test_planted_unit_answers_with_its_token_and_contexts_decode_to_the_tokenizers_text(syn, store, tmp_path):
    result = top(store, POINT, PLANTED, k=8, context=4, tokenizer=syn.tokenizer)
    n_target = sum(1 for d, p, _ in syn.rows if syn.docs[d][p] == syn.target)
    assert n_target >= 8
    assert len(result.contexts) == 8
    assert result.values.tolist() == sorted(result.values.tolist(), reverse=True)
    for ctx in result.contexts:
        assert ctx.token_ids[ctx.center] == syn.target
        assert ctx.value > 5
        window = expected_window(syn, ctx.row, 4)
        d, p, _ = syn.rows[ctx.row]
        assert (ctx.doc_id, ctx.position) == (d, p)
        # the tokens of those positions in the document, as the tokenizer made them
        first = syn.rows[window[0]][1]
        want_ids = syn.docs[d][first : first + len(window)]
        assert ctx.token_ids == want_ids
        assert ctx.center == p - first
        assert ctx.text == syn.tokenizer.decode(want_ids)
        assert "".join(ctx.pieces) == ctx.text
        assert ctx.pieces[ctx.center] == syn.tokenizer.decode([syn.target])
        # the unit's value on every context token is the stored one
        x = _x(store)
        assert ctx.values == [x[r, PLANTED].item() for r in window]
    text = str(result)
    assert f"unit {PLANTED}" in text and "[[" in text
    assert result.frequency == pytest.approx(float((_x(store)[:, PLANTED] > 0).float().mean()))


def test_contexts_stop_at_sequence_and_document_boundaries(syn, store):
    index = build_index(store, POINT, k=40)
    from hookscope.top.contexts import build_contexts
    from hookscope.top.encoders import neurons

    units = list(range(UNITS))
    ctxs = build_contexts(store, POINT, neurons(UNITS), units, index.rows, index.values, context=6)
    for u in units:
        for ctx in ctxs[u]:
            window = expected_window(syn, ctx.row, 6)
            assert len(ctx.token_ids) == len(window)
            assert ctx.token_ids == [syn.docs[syn.rows[r][0]][syn.rows[r][1]] for r in window]


def test_saved_index_is_reused_and_refused_after_the_store_changes(syn, tmp_path):
    import shutil

    path = tmp_path / "store"
    shutil.copytree(syn.path, path, ignore=shutil.ignore_patterns("top"))
    store = open_store(path)
    first = top(store, POINT, PLANTED, k=5)
    saved = Path(index_path(store, POINT, neurons(UNITS)))
    assert saved.is_file()
    loaded = load_index(store, POINT, neurons(UNITS))
    fresh = build_index(store, POINT, k=32)
    assert torch.equal(loaded.rows, fresh.rows) and torch.equal(loaded.hist, fresh.hist)
    mtime = saved.stat().st_mtime_ns
    again = top(open_store(path), POINT, PLANTED, k=5)
    assert saved.stat().st_mtime_ns == mtime and torch.equal(again.rows, first.rows)
    # resume the extraction: one more batch appended makes another shard
    with ShardWriter(path, syn.settings, shard_rows=150) as w:
        n = 16
        x = torch.full((n, UNITS), 50.0).half()
        meta = {k: torch.arange(n) for k in ("token_ids", "doc_ids", "positions", "seq_ids")}
        w.write(max(w.done_batches) + 1, {POINT: x}, meta)
    changed = open_store(path)
    with pytest.raises(StaleIndexError, match="no longer matches the store.*shard list differs.*rebuild"):
        top(changed, POINT, PLANTED, k=5)
    with pytest.raises(StaleIndexError):
        load_index(changed, POINT, neurons(UNITS))
    rebuilt = top(changed, POINT, PLANTED, k=5, rebuild=True)
    assert rebuilt.values[0].item() == 50.0 and rebuilt.rows[0].item() == len(store)  # the new rows win
    # a store with other settings (same shard names) is refused too
    idx_meta = json.loads(__import__("safetensors").safe_open(saved, "pt").metadata()["hookscope-top"])
    assert idx_meta["settings_hash"] == changed.manifest.settings_hash


def test_index_keeping_fewer_rows_than_asked_is_refused(syn, tmp_path):
    import shutil

    shutil.copytree(syn.path, tmp_path / "s", ignore=shutil.ignore_patterns("top"))
    store = open_store(tmp_path / "s")
    get_index(store, POINT, k=4)
    with pytest.raises(StoreError, match="keeps 4 rows per unit, 10 asked"):
        get_index(store, POINT, k=10)
    assert get_index(store, POINT, k=10, rebuild=True).k == 10


def test_user_errors(store):
    with pytest.raises(StoreError, match="no point 'nope'"):
        top(store, "nope", 0, k=2)
    with pytest.raises(StoreError, match="unit 12 is out of range.*12 units"):
        top(store, POINT, UNITS, k=2)
    with pytest.raises(HookscopeError, match="no such SAE"):
        top(store, POINT, 0, sae="/no/such/sae")


# -- SAE features ---------------------------------------------------------------------------------


def _sae_weights(d_in: int, d_sae: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d_in, d_sae, generator=g)
    W[:, 0] = 0
    W[PLANTED, 0] = 1.0  # feature 0 reads the planted unit: it fires on the target token
    return {
        "W_enc": W,
        "b_enc": torch.randn(d_sae, generator=g) * 0.1 - 0.2,
        "W_dec": torch.randn(d_sae, d_in, generator=g),
        "b_dec": torch.randn(d_in, generator=g) * 0.1,
        "threshold": torch.rand(d_sae, generator=g) * 0.5,
    }


def _reference_encode(x, w, arch, k=None, apply_b_dec=True):
    """SAELens' encode written out: (x - b_dec) @ W_enc + b_enc, then the architecture's activation."""
    pre = (x - w["b_dec"] if apply_b_dec else x) @ w["W_enc"] + w["b_enc"]
    if arch == "standard":
        return pre.relu()
    if arch == "jumprelu":
        return pre.relu() * (pre > w["threshold"])
    vals, idx = torch.topk(pre, k, dim=-1)
    return torch.zeros_like(pre).scatter(-1, idx, vals.relu())


def _write_saelens(directory, w, arch, **cfg):
    directory.mkdir(parents=True)
    tensors = {k: v for k, v in w.items() if arch == "jumprelu" or k != "threshold"}
    save_file(tensors, directory / "sae_weights.safetensors")
    (directory / "cfg.json").write_text(
        json.dumps(
            {
                "architecture": arch,
                "d_in": w["W_enc"].shape[0],
                "d_sae": w["W_enc"].shape[1],
                "dtype": "float32",
                "apply_b_dec_to_input": True,
                "normalize_activations": "none",
                **cfg,
            }
        )
    )
    return directory


def _assert_same_top(index, ref, k):
    """Same values (to float32 rounding of a differently batched matmul) and same rows wherever
    neighbouring values are not within that rounding of each other."""
    want_v, want_r = brute_force_top(ref, k)
    assert torch.allclose(index.values, want_v, atol=1e-5, rtol=1e-5)
    gap = (want_v[:, :-1] - want_v[:, 1:]).abs() > 1e-4
    clear = torch.ones_like(want_r, dtype=torch.bool)
    clear[:, :-1] &= gap
    clear[:, 1:] &= gap
    assert torch.equal(index.rows[clear], want_r[clear])


@pytest.mark.parametrize("arch", ["standard", "jumprelu", "topk"])
def test_saelens_directory_features(syn, store, tmp_path, arch):
    w = _sae_weights(UNITS, 24)
    cfg = {"k": 4} if arch == "topk" else {}
    sae_dir = _write_saelens(tmp_path / arch, w, arch, **cfg)
    enc = load_encoder(sae_dir)
    assert enc.units == 24 and enc.source["architecture"] == arch
    ref = _reference_encode(_x(store), w, arch, k=4)
    index = build_index(store, POINT, encoder=enc, k=6, batch_rows=100)
    _assert_same_top(index, ref, 6)
    assert torch.equal(index.fires, (ref >= 2.0**-15).sum(0))
    result = top(store, POINT, 0, k=5, context=3, sae=sae_dir, tokenizer=syn.tokenizer)
    assert result.source["kind"] == "sae" and "SAE feature 0" in str(result)
    for ctx in result.contexts:
        assert ctx.token_ids[ctx.center] == syn.target
        window = expected_window(syn, ctx.row, 3)
        want = ref[window, 0].tolist()
        assert ctx.values == pytest.approx(want, abs=1e-5)


def test_plain_encoder_file_in_linear_layout(store, tmp_path):
    w = _sae_weights(UNITS, 10, seed=3)
    path = tmp_path / "enc.safetensors"
    save_file({"weight": w["W_enc"].T.contiguous(), "bias": w["b_enc"]}, path)
    enc = load_encoder(path)
    ref = _reference_encode(_x(store), w, "standard", apply_b_dec=False)
    _assert_same_top(build_index(store, POINT, encoder=enc, k=5, batch_rows=33), ref, 5)


def test_sae_errors(store, tmp_path):
    w = _sae_weights(UNITS, 8)
    with pytest.raises(SAEError, match="architecture 'gated' is not supported"):
        load_encoder(_write_saelens(tmp_path / "g", w, "gated"))
    with pytest.raises(SAEError, match="normalize_activations='layer_norm' is not supported"):
        load_encoder(_write_saelens(tmp_path / "n", w, "standard", normalize_activations="layer_norm"))
    wrong = {k: v for k, v in _sae_weights(UNITS + 1, 8).items()}
    enc = load_encoder(_write_saelens(tmp_path / "d", wrong, "standard"))
    with pytest.raises(StoreError, match="reads 13 inputs but 'blocks.0.mlp.post' has 12"):
        build_index(store, POINT, encoder=enc)
    bad = tmp_path / "bad.safetensors"
    save_file({"foo": torch.zeros(2)}, bad)
    with pytest.raises(SAEError, match="W_enc"):
        load_encoder(bad)


# -- the command line, on a store made by hookscope extract ---------------------------------------


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    from hookscope.extract import ExtractConfig, extract
    from hookscope.testing import save_tiny

    root = tmp_path_factory.mktemp("top-cli")
    model = save_tiny("gpt2", root / "model", d_model=32, n_layers=2, n_heads=2, context=64)
    out = root / "store"
    extract(
        ExtractConfig(
            out=str(out),
            model=str(model),
            points=["blocks.0.mlp.post"],
            context=32,
            batch_size=4,
            max_tokens=1024,
            shard_rows=300,
            progress=False,
        )
    )
    return out, model


def test_cli_top_prints_the_marked_token_and_values(extracted, capsys):
    from transformers import AutoTokenizer

    from hookscope.cli import main

    out, model = extracted
    assert main(["top", str(out), "--unit", "3", "--k", "4", "--context", "3", "--no-progress"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    store = open_store(out)
    tok = AutoTokenizer.from_pretrained(model)
    want = hs.top(store, "blocks.0.mlp.post", 3, k=4, context=3, tokenizer=tok)
    x = store.tensor("blocks.0.mlp.post").float()[:, 3]
    assert want.values.tolist() == sorted(x.tolist(), reverse=True)[:4]
    assert lines[0].startswith("blocks.0.mlp.post unit 3: fires (> 0) on")
    assert len(lines) == 5
    for line, ctx in zip(lines[1:], want.contexts, strict=True):
        marked = line.split("[[", 1)[1].split("]]", 1)[0]  # control characters are shown escaped
        piece = ctx.pieces[ctx.center]
        assert marked == piece.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r").lstrip()
        assert ctx.pieces[ctx.center] == tok.decode([ctx.token_ids[ctx.center]])
        assert f"{ctx.value:.4g}" in line
        assert f"doc {ctx.doc_id} pos {ctx.position}" in line
        row = store[ctx.row]
        assert int(row["token_ids"]) == ctx.token_ids[ctx.center]


def test_cli_top_html_and_errors(extracted, tmp_path, capsys):
    from hookscope.cli import main

    out, _ = extracted
    page = tmp_path / "page.html"
    assert main(["top", str(out), "--html", str(page), "--units", "0:6", "--k", "3", "--no-progress"]) == 0
    html = page.read_text()
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "") and "https://" not in html
    data = json.loads(html.split('<script type="application/json" id="data">')[1].split("</script>")[0])
    assert [u["u"] for u in data["units"]] == list(range(6))
    assert all(len(u["ctx"]) == 3 for u in data["units"])
    assert main(["top", str(out), "--no-progress"]) == 2
    assert "give --unit N" in capsys.readouterr().err
    assert main(["top", str(out), "--unit", "100000", "--no-progress"]) == 2
    assert "out of range" in capsys.readouterr().err
    assert main(["top", str(out), "--unit", "1", "--tokenizer", str(tmp_path), "--no-progress"]) == 2
    assert "tokenizer" in capsys.readouterr().err
    from hookscope.testing import train_tokenizer

    train_tokenizer(bert=True).save_pretrained(tmp_path / "other")  # loads fine, but is another one
    other = str(tmp_path / "other")
    assert main(["top", str(out), "--unit", "1", "--tokenizer", other, "--no-progress"]) == 2
    assert "not the one this store was made with" in capsys.readouterr().err


def test_page_data_for_sae_features(syn, store, tmp_path):
    from hookscope.top import page_data, write_page

    w = _sae_weights(UNITS, 16)
    enc = load_encoder(_write_saelens(tmp_path / "sae", w, "jumprelu"))
    index = get_index(store, POINT, encoder=enc, k=6, save=False)
    data = page_data(store, index, enc, units=[0, 5, 9], k=4, context=2, tokenizer=syn.tokenizer)
    ref = _reference_encode(_x(store), w, "jumprelu")
    assert data["source"]["kind"] == "sae" and [u["u"] for u in data["units"]] == [0, 5, 9]
    for u in data["units"]:
        assert u["fires"] == int((ref[:, u["u"]] >= 2.0**-15).sum())
        for c in u["ctx"]:
            window = expected_window(syn, c["row"], 2)
            assert c["a"] == pytest.approx(ref[window, u["u"]].tolist(), abs=1e-4)
            assert "".join(data["strings"][i] for i in c["t"]) == syn.tokenizer.decode(
                [syn.docs[syn.rows[r][0]][syn.rows[r][1]] for r in window]
            )
    page = write_page(tmp_path / "sae.html", data)
    assert "(SAE)" in page.read_text()
