"""Non-finite activations: NaN and Inf are counted per point, equal to an independent count, and
reported by `hookscope extract` and `hookscope inspect`; `--on-nonfinite error` refuses to write
them and keeps every batch before the first bad one.

The model is the tiny GPT-2 with two token embeddings poisoned: one set to NaN (which attention
then spreads to later positions of its sequence) and one scaled by 1e8, finite in the model but
infinite once stored as float16. Both tokens first occur a few batches into the corpus.
test_extract.py covers a NaN layer-norm weight counted in the summary and refused; this file adds
Inf, the float16 cast, several points, the CLI reports and what a refusal leaves on disk.
"""

from __future__ import annotations

import contextlib
import io
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fault_log import record
from faultkit import compare_stores, write_corpus

import hookscope as hs
from hookscope.cli import main
from hookscope.sources import batches, iter_documents, pack
from hookscope.store import open_store

POINTS = ["embed", "blocks.1.resid_post", "blocks.0.mlp.post"]
CONTEXT, BATCH = 32, 4


@dataclass
class Poisoned:
    model: Path
    corpus: Path
    huge: int  # the token whose embedding is scaled by 1e8
    nan: int  # the token whose embedding is NaN
    first_bad_batch: int


def packed(corpus: Path, tokenizer):
    """The batches extraction makes, with its keep mask (no padding, no start / separator tokens)."""
    for batch in batches(pack(iter_documents(str(corpus)), tokenizer, context=CONTEXT), BATCH):
        yield batch, batch["attention_mask"].bool() & ~batch["special_mask"]


@pytest.fixture(scope="module")
def poisoned(tiny_dirs, tmp_path_factory) -> Poisoned:
    root = tmp_path_factory.mktemp("numerics")
    corpus = write_corpus(root / "corpus.txt")
    loaded = hs.load(str(tiny_dirs["gpt2"]))
    first: dict[int, int] = {}
    for b, (batch, keep) in enumerate(packed(corpus, loaded.tokenizer)):
        for token in batch["input_ids"][keep].tolist():
            first.setdefault(token, b)
    huge, nan = sorted((t for t, b in first.items() if b >= 3), key=lambda t: (first[t], t))[:2]
    with torch.no_grad():
        loaded.model.transformer.wte.weight[huge] *= 1e8
        loaded.model.transformer.wte.weight[nan] = float("nan")
    loaded.model.save_pretrained(root / "model")
    loaded.tokenizer.save_pretrained(root / "model")
    return Poisoned(root / "model", corpus, huge, nan, min(first[huge], first[nan]))


def plain_counts(p: Poisoned, dtype: torch.dtype) -> Counter:
    """Non-finite values per point, by plain forward hooks on the modules, cast as the store casts."""
    loaded = hs.load(str(p.model))
    model = loaded.model
    seen = {}
    put = seen.__setitem__
    hooks = [
        model.transformer.wte.register_forward_hook(lambda m, a, o: put("embed", o)),
        model.transformer.h[1].register_forward_hook(lambda m, a, o: put("blocks.1.resid_post", o)),
        model.transformer.h[0].mlp.c_proj.register_forward_pre_hook(
            lambda m, a: put("blocks.0.mlp.post", a[0])
        ),
    ]
    counts = Counter({point: 0 for point in POINTS})
    try:
        with torch.no_grad():
            for batch, keep in packed(p.corpus, loaded.tokenizer):
                model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                for point in POINTS:
                    x = seen[point][0] if isinstance(seen[point], tuple) else seen[point]
                    counts[point] += int((~torch.isfinite(x[keep].to(dtype))).sum())
    finally:
        for h in hooks:
            h.remove()
    return counts


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def extract_args(p: Poisoned, out: Path, dtype: str, *extra: str) -> list[str]:
    return [
        "extract",
        str(p.model),
        "--out",
        str(out),
        "--points",
        ",".join(POINTS),
        "--data",
        str(p.corpus),
        "--context",
        str(CONTEXT),
        "--batch-size",
        str(BATCH),
        "--dtype",
        dtype,
        "--shard-rows",
        "300",
        "--no-progress",
        *extra,
    ]


@pytest.fixture(scope="module")
def warned(poisoned, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """dtype -> (a store extracted with the default --on-nonfinite warn, what extract printed)."""
    runs = {}
    for dtype in ("float16", "float32"):
        out = tmp_path_factory.mktemp(dtype) / "store"
        code, text, err = cli(*extract_args(poisoned, out, dtype))
        assert code == 0, err
        runs[dtype] = out, text
    return runs


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.slow
def test_nonfinite_values_are_counted_per_point_and_reported(dtype, poisoned, warned):
    out, printed = warned[dtype]
    store = open_store(out, verify=True)
    stored = {point: store.tensor(point) for point in POINTS}
    in_rows = {point: int((~torch.isfinite(x)).sum()) for point, x in stored.items()}
    plain = plain_counts(poisoned, getattr(torch, dtype))
    counted = {point: store.stats[point].nonfinite for point in POINTS}
    code, shown, _ = cli("inspect", str(out))
    summary = printed.split("per point:")[-1]
    reported = [f"{point}: {plain[point]}" in summary for point in POINTS if plain[point]]
    inspected = [
        any(
            line.strip().startswith(point + ":") and f", {plain[point]} NaN/Inf" in line
            for line in shown.splitlines()
        )
        for point in POINTS
        if plain[point]
    ]
    record(
        "numerics",
        f"NaN / Inf per point, stored as {dtype}",
        tried=len(POINTS),
        survived=sum(counted[p] == in_rows[p] == plain[p] for p in POINTS),
    )
    assert counted == in_rows == dict(plain)  # the manifest, the stored rows and plain hooks agree
    assert all(reported) and all(inspected) and code == 0, (printed, shown)
    nan_rows = int((store.tensor("token_ids") == poisoned.nan).sum())
    assert int(torch.isnan(stored["embed"]).sum()) == 64 * nan_rows  # d_model 64
    # the 1e8 embedding is finite in the model: infinite only once cast to float16
    assert (int(torch.isinf(stored["embed"]).sum()) > 0) == (dtype == "float16")
    # attention spreads a NaN token to the later positions of its sequence
    assert int(torch.isnan(stored["blocks.1.resid_post"]).sum()) > int(torch.isnan(stored["embed"]).sum())


def test_on_nonfinite_error_writes_none_of_them(poisoned, warned, tmp_path):
    out = tmp_path / "store"
    code, _, err = cli(*extract_args(poisoned, out, "float16", "--on-nonfinite", "error"))
    store = open_store(out, verify=True)
    finite = all(bool(torch.isfinite(store.tensor(point)).all()) for point in POINTS)
    kept = store.manifest.done_batches()
    code_again, _, _ = cli(*extract_args(poisoned, out, "float16"))  # the same command, now keeping them
    diff = compare_stores(out, warned["float16"][0])
    refused = code == 2 and finite and kept == set(range(poisoned.first_bad_batch))
    record(
        "numerics",
        "--on-nonfinite error: refused, nothing non-finite written, earlier batches kept",
        survived=int(refused and code_again == 0 and diff["rows_lost"] == diff["rows_duplicated"] == 0),
    )
    assert code == 2 and err.startswith("hookscope: error: ") and "non-finite" in err, err
    assert f"batch {poisoned.first_bad_batch}:" in err and "--on-nonfinite warn" in err
    assert finite and all(s.nonfinite == 0 for s in store.stats.values())
    assert kept == set(range(poisoned.first_bad_batch))  # every batch before the first bad one, no more
    assert code_again == 0
    assert diff["rows_lost"] == diff["rows_duplicated"] == 0 and diff["same_values"]
