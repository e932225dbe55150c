"""Every script in examples/ runs on a tiny model and shows what it claims.

Each example's `main(argv)` returns the figures it prints; these tests check them against
references computed here without hookscope (plain transformers outputs, torch.autograd, hand-made
hooks, the files written) or against the claim itself (exact restoration, bit-identical resume).
"""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import gate
import pytest
import torch
import torch.nn.functional as F
from gate import need
from matplotlib.image import imread
from transformers import AutoModelForCausalLM, AutoTokenizer

import hookscope as hs
from hookscope.testing import _CORPUS, save_tiny

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
N_LAYERS = 3


def example(name: str):
    """Import examples/<name>.py as a module (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def assert_png(path: Path) -> None:
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> str:
    return str(
        save_tiny(
            "gpt2",
            tmp_path_factory.mktemp("examples") / "gpt2",
            d_model=64,
            n_layers=N_LAYERS,
            n_heads=4,
            context=64,
        )
    )


def reference(path: str, dtype: torch.dtype = torch.float32):
    """The same model through plain transformers, no hookscope."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval(), AutoTokenizer.from_pretrained(path)


def test_activation_patching_restores_the_clean_logit_difference(gpt2_dir, tmp_path):
    clean, corrupted = "The quick brown fox jumps over the lazy", "The quick brown dog jumps over the lazy"
    r = example("activation_patching").main(
        [
            "--model",
            gpt2_dir,
            "--clean",
            clean,
            "--corrupted",
            corrupted,
            "--answers",
            " dog",
            " fox",
            "--out",
            str(tmp_path),
        ]
    )
    model, tok = reference(gpt2_dir)
    a, b = tok(" dog").input_ids[0], tok(" fox").input_ids[0]
    ids = {t: tok(t, return_tensors="pt").input_ids for t in (clean, corrupted)}

    def logit_diff(text: str, hook=None) -> float:
        handle = model.transformer.h[hook[0]].attn.c_proj.register_forward_pre_hook(hook[1]) if hook else None
        try:
            with torch.no_grad():
                logits = model(ids[text]).logits[0, -1]
        finally:
            if handle:
                handle.remove()
        return float(logits[a] - logits[b])

    assert r["clean"] == pytest.approx(logit_diff(clean), abs=1e-6)
    assert r["corrupted"] == pytest.approx(logit_diff(corrupted), abs=1e-6)
    span = r["clean"] - r["corrupted"]
    patched = r["corrupted"] + r["by_position"] * span  # the patched logit differences
    # the last layer at the last position gives back the clean logit difference exactly...
    assert float(patched[-1, -1]) == pytest.approx(r["clean"], abs=1e-6)
    # ... and no other position of the last layer changes it (only per-position ops follow)
    assert torch.all(r["by_position"][-1, :-1].abs() < 1e-4)
    # before the swapped token the two runs are identical (causal attention): patching does nothing
    first_change = int((ids[clean][0] != ids[corrupted][0]).nonzero()[0])
    assert torch.all(r["by_position"][:, :first_change] == 0)

    # one head, by hand: overwrite its slice of c_proj's input with the clean run's
    layer, head, d_head = 1, 2, 16
    kept = {}
    logit_diff(clean, (layer, lambda m, args: kept.setdefault("z", args[0].clone())))

    def patch_head(m, args):
        z = args[0].clone()
        z[..., head * d_head : (head + 1) * d_head] = kept["z"][..., head * d_head : (head + 1) * d_head]
        return (z,)

    by_hand = (logit_diff(corrupted, (layer, patch_head)) - r["corrupted"]) / span
    assert float(r["by_head"][layer, head]) == pytest.approx(by_hand, abs=1e-3)
    assert r["by_position"].shape == (N_LAYERS, ids[clean].shape[1]) and r["by_head"].shape == (N_LAYERS, 4)
    assert_png(r["picture"])


def test_gradient_x_activation_matches_the_loss_change(gpt2_dir, tmp_path):
    text = "The quick brown fox jumps over the lazy dog."
    r = example("gradient_attribution").main(["--model", gpt2_dir, "--text", text, "--out", str(tmp_path)])
    # the first-order sum predicts the loss change of a (1 - eps) step at every layer
    scale = max(abs(m) for m in r["measured"])
    for predicted, measured in zip(r["predicted"], r["measured"], strict=True):
        assert predicted == pytest.approx(measured, abs=1e-2 * scale)
    assert max(r["errors"]) < 1e-2

    # gradient x activation per token against torch.autograd on transformers' own hidden states
    # (the last entry of hidden_states is after ln_f, so the blocks before the last one)
    model, tok = reference(gpt2_dir, torch.float64)  # the example runs in float64 too
    ids = tok(text, return_tensors="pt").input_ids
    out = model(ids, output_hidden_states=True)
    loss = F.cross_entropy(out.logits[0, :-1], ids[0, 1:])
    assert r["loss"] == pytest.approx(loss.item(), rel=1e-9)
    hidden = out.hidden_states[1:N_LAYERS]
    grads = torch.autograd.grad(loss, hidden)
    expected = torch.stack([(g * h).sum(-1)[0] for g, h in zip(grads, hidden, strict=True)])
    torch.testing.assert_close(r["per_token"][: N_LAYERS - 1], expected.detach(), rtol=1e-7, atol=1e-12)
    assert_png(r["picture"])


@pytest.mark.slow
def test_linear_probe_beats_chance(gpt2_dir, tmp_path):
    r = example("linear_probe").main(["--model", gpt2_dir, "--out", str(tmp_path)])
    labels = r["labels"]
    for train, test in r["splits"].values():  # disjoint, and balanced held-out sets: chance is 50%
        assert not set(train) & set(test) and labels[test].mean() == 0.5
    train, test = r["splits"]["new sentences"]
    assert len(test) == 48
    # a random tiny model carries the word to the last token: the best layer clearly beats chance
    # on new sentences (>= 75% of 48: p < 1e-3 for a coin)...
    accuracy = r["accuracy"]["new sentences"]
    assert max(accuracy.values()) >= 0.75
    # ... while the last token's embedding alone (a full stop) knows nothing of it
    assert accuracy["blocks.0.resid_pre"] <= 0.65

    # the probed features are transformers' hidden states at each sentence's last real token
    model, tok = reference(gpt2_dir)
    tok.pad_token = tok.eos_token
    batch = tok(r["texts"], return_tensors="pt", padding=True)
    with torch.no_grad():
        hidden = model(**batch, output_hidden_states=True).hidden_states
    rows = torch.arange(len(labels)), batch["attention_mask"].sum(1) - 1
    for name, h in [
        ("blocks.0.resid_pre", hidden[0]),
        ("blocks.0.resid_post", hidden[1]),
        ("blocks.1.resid_post", hidden[2]),
    ]:
        torch.testing.assert_close(r["features"][name], h[rows], rtol=1e-5, atol=1e-6)
    assert_png(r["picture"])


@pytest.mark.slow
def test_saelens_sae_learns_and_resumes_exactly(gpt2_dir, tmp_path):
    need("sae_lens")
    lines = list(dict.fromkeys(_CORPUS))
    rng = random.Random(0)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(rng.sample(lines, 3)) for _ in range(300)))
    sae = example("sae_from_store")
    steps, batch = 120, 64
    r = sae.main(
        [
            "--model",
            gpt2_dir,
            "--layer",
            "1",
            "--data",
            str(corpus),
            "--tokens",
            "4096",
            "--context",
            "32",
            "--shard-rows",
            "256",
            "--batch-size",
            str(batch),
            "--steps",
            str(steps),
            "--out",
            str(tmp_path / "sae"),
        ]
    )
    # SAELens's own metrics on held-out rows: from nothing explained to most of the variance
    assert r["before"]["explained_variance"] < 0.1 and r["after"]["explained_variance"] > 0.6
    assert 0 < r["after"]["l0"] < r["before"]["l0"]
    assert r["epochs"] > 1  # the endless reader carried SAELens's trainer past the first epoch
    # the saved SAE names its model and hook
    assert r["metadata"]["model_name"] == gpt2_dir
    assert r["metadata"]["hook_name"] == "blocks.1.hook_resid_post"
    # resumed from SAELens's halfway checkpoint + the reader's cursor: the same weights, bit for bit
    assert r["same_weights"] and r["resumed_cursor"] == r["cursor"]
    store = hs.open_store(tmp_path / "sae" / "store")
    rows_seen = (steps + 10) * batch  # + SAELens's 10 batches for its norm estimate
    train_rows = len(store.dataset("blocks.1.resid_post", split="train"))
    assert r["cursor"]["epoch"] == rows_seen // (train_rows // batch * batch)
    # the features' firing rates are SAELens's own sparsity measurement: their mean is the L0
    assert float((10 ** r["log_feature_sparsity"]).sum()) == pytest.approx(r["after"]["l0"], rel=0.5)
    assert_png(r["picture"])


def test_profile_model_before_and_after_a_dtype_change(gpt2_dir, tmp_path):
    r = example("profile_model").main(
        [
            "--model",
            gpt2_dir,
            "--batch",
            "2",
            "--seq",
            "16",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    blocks = [f"blocks.{i}" for i in range(N_LAYERS)]
    for dtype, report in r["reports"].items():
        rows = [row for row in report.rows if row.kind == "block"]
        assert [row.name for row in rows] == blocks and all(row.calls == 1 for row in rows)
        assert list(r["block_ms"][dtype]) == blocks and all(ms > 0 for ms in r["block_ms"][dtype].values())
        folder = tmp_path / dtype
        assert (folder / "table.txt").read_text() == report.summary() + "\n"
        events = json.loads((folder / "trace.json").read_text())["traceEvents"]
        names = {event.get("name") for event in events}
        assert {f"hs::{b}" for b in blocks} <= names
        assert_png(folder / "time_per_block.png")
    # the cast happened: in inference mode a block keeps only its output (and KV cache), now half the bytes
    memory = {
        dtype: [row.cpu_mem_bytes for row in report.rows if row.kind == "block"]
        for dtype, report in r["reports"].items()
    }
    assert all(m > 0 for m in memory["bfloat16"]) and memory["float32"] == [2 * m for m in memory["bfloat16"]]
    assert_png(r["picture"])


@pytest.mark.slow
def test_hooks_attach_without_repr(gpt2_dir, tmp_path):
    r = example("hooks_without_hidden_cost").main(
        ["--model", gpt2_dir, "--tensors", "20", "--rows", "8", "--out", str(tmp_path)]
    )
    us, ours = r["us"], f"hookscope on {Path(gpt2_dir).name}, TensorCache"
    # the cost the example shows is repr(): counted, not timed (the timings: bench/bench_core.py, a)
    assert r["repr_calls"]["hookscope"] == 0
    assert us[ours] > 0 and us[f"hookscope on {Path(gpt2_dir).name}, bare function"] > 0
    assert_png(r["picture"])
    if gate.problem("tl3") is not None and "tl3" not in gate.required():  # HookedTransformer: 3.x only
        assert r["same_activation"] is None  # the script left the comparison out
        return
    assert r["repr_calls"]["hookscope on HookedTransformer"] == 0
    assert r["repr_calls"]["TransformerLens add_hook"] > 0  # one per add_hook
    assert us["TransformerLens add_hook + reset_hooks, TensorCache"] > 0
    assert r["same_activation"] is True
