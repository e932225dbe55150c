"""The extraction pipeline end to end: round trip against plain hooks, torchrun ranks resuming
elastically, and the bad inputs a user can hit. The elastic-resume tests run for every source
(tests/kit/source_kit.py: text, text + generated continuation, images). A SIGKILL and the same
command again: the kill sweep, tests/faults/test_faults_kill.py."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from elastic_kit import assert_same_rows_as, run_elastic
from forkserver import ForkServer
from helpers import corpus_fixture, shard_digests
from source_kit import SOURCES, Case, PerSource, make_case

import hookscope as hs
from hookscope.extract import ExtractConfig, extract
from hookscope.sources import batches, iter_documents, pack
from hookscope.store import open_store

corpus = corpus_fixture(80)


def config(tiny_dirs, corpus, out, **overrides) -> ExtractConfig:
    base = dict(
        out=str(out),
        model=str(tiny_dirs["gpt2"]),
        points=["blocks.1.resid_post", "blocks.0.mlp.post"],
        data=str(corpus),
        context=32,
        batch_size=4,
        dtype="float16",
        shard_rows=150,
        progress=False,
    )
    return ExtractConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def cases(tiny_dirs, tmp_path_factory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("sources")
    return {
        source: make_case(
            source,
            tiny_dirs,
            root / source,
            docs=40,
            images=60,
            dtype="float16",
            points=["blocks.1.resid_post", "blocks.0.mlp.post"],
            shard_rows=150,
        )
        for source in SOURCES
    }


@pytest.fixture(scope="module")
def references(cases, tmp_path_factory) -> dict[str, Path]:
    """Each source's uninterrupted one-process store, made when a test first asks for it."""

    def make(source: str) -> Path:
        out = tmp_path_factory.mktemp(f"ref-{source}") / "store"
        extract(ExtractConfig(**cases[source].config(out)))
        return out

    return PerSource(make)


@pytest.fixture(scope="module")
def server(tiny_dirs) -> ForkServer:
    server = ForkServer.shared()
    server.warm("faultkit:load_model", path=str(tiny_dirs["gpt2"]))
    return server


@pytest.fixture(scope="module")
def reference_store(tiny_dirs, corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "store"
    extract(config(tiny_dirs, corpus, out))
    return out


def test_round_trip_equals_plain_hooks(tiny_dirs, corpus, reference_store):
    """Every stored row equals the activation a plain forward hook sees, and traces back to its
    token in its document."""
    loaded = hs.load(str(tiny_dirs["gpt2"]))
    model, tok = loaded.model, loaded.tokenizer
    block1 = model.transformer.h[1]
    mlp0_proj = model.transformer.h[0].mlp.c_proj
    want_resid, want_mlp, want_ids = [], [], []
    seen = {}
    h1 = block1.register_forward_hook(
        lambda m, a, o: seen.__setitem__("resid", o[0] if isinstance(o, tuple) else o)
    )
    h2 = mlp0_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("mlp", a[0]))
    try:
        with torch.no_grad():
            for batch in batches(pack(iter_documents(str(corpus)), tok, context=32), 4):
                keep = batch["attention_mask"].bool() & ~batch["special_mask"]
                model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                want_resid.append(seen["resid"][keep].to(torch.float16))
                want_mlp.append(seen["mlp"][keep].to(torch.float16))
                want_ids.append(batch["input_ids"][keep])
    finally:
        h1.remove()
        h2.remove()
    store = open_store(reference_store, verify=True)
    assert store.num_shards > 3  # several shards, so resume tests below cut mid-store
    assert torch.equal(store.tensor("blocks.1.resid_post"), torch.cat(want_resid))
    assert torch.equal(store.tensor("blocks.0.mlp.post"), torch.cat(want_mlp))
    token_ids = store.tensor("token_ids")
    assert torch.equal(token_ids, torch.cat(want_ids))
    # each row's (doc_id, position) points at that very token of the tokenizer's own output
    docs = list(iter_documents(str(corpus)))
    doc_tokens = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
    for tid, doc, pos in zip(
        token_ids.tolist(), store.tensor("doc_ids").tolist(), store.tensor("positions").tolist(), strict=True
    ):
        assert doc_tokens[doc][pos] == tid
    assert store.manifest.settings["points"] == ["blocks.1.resid_post", "blocks.0.mlp.post"]


def _for_every_source(cases: list, every_source: set) -> list:
    """(source, *case) params: all cases for text, the `every_source` ones for the other sources
    by default, the rest of theirs marked full (run with --full)."""
    return [
        pytest.param(
            source,
            *case,
            id="-".join(map(str, (source, *case))),
            marks=(pytest.mark.full,) if source != "text" and case not in every_source else (),
        )
        for source in SOURCES
        for case in cases
    ]


def test_changed_command_is_refused(tiny_dirs, corpus, reference_store, tmp_path):
    out = tmp_path / "store"
    extract(config(tiny_dirs, corpus, out, max_tokens=200))
    before = shard_digests(out)
    with pytest.raises(hs.StoreError, match="context"):
        extract(config(tiny_dirs, corpus, out, context=16))
    with pytest.raises(hs.StoreError, match="dtype"):
        extract(config(tiny_dirs, corpus, out, dtype="bfloat16"))
    assert shard_digests(out) == before  # nothing written was lost or touched


def test_bad_inputs(tiny_dirs, corpus, tmp_path):
    with pytest.raises(hs.DataError):
        extract(config(tiny_dirs, corpus, tmp_path / "a", data=str(tmp_path / "missing.txt")))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(hs.DataError):
        extract(config(tiny_dirs, corpus, tmp_path / "b", data=str(empty)))
    with pytest.raises(hs.UnknownPointError, match="blocks.1.resid_post"):
        extract(config(tiny_dirs, corpus, tmp_path / "c", points=["blocks.1.resid_pots"]))
    assert not (tmp_path / "c").exists()  # the name was checked before any directory was made
    blocker = tmp_path / "a-file"  # a directory cannot be made under a file, even by root
    blocker.write_text("not a directory")
    with pytest.raises(hs.StoreError, match="writable"):
        extract(config(tiny_dirs, corpus, blocker / "store"))


def test_nonfinite_counted_or_refused(tiny_dirs, corpus, tmp_path):
    """A NaN injected into block 0's output reaches the stored point: counted by default,
    refused with on_nonfinite='error' (and nothing of that batch written)."""
    loaded = hs.load(str(tiny_dirs["gpt2"]))
    ln = loaded.model.transformer.h[1].ln_1
    with torch.no_grad():
        ln.weight[3] = float("nan")
    poisoned = tmp_path / "poisoned"
    loaded.model.save_pretrained(poisoned)
    loaded.tokenizer.save_pretrained(poisoned)
    summary = extract(config(tiny_dirs, corpus, tmp_path / "warn", model=str(poisoned), max_tokens=300))
    rows = open_store(tmp_path / "warn").tensor("blocks.1.resid_post")
    assert summary.nonfinite["blocks.1.resid_post"] == int((~torch.isfinite(rows)).sum()) > 0
    assert summary.nonfinite["blocks.0.mlp.post"] == 0
    with pytest.raises(hs.HookscopeError, match="non-finite"):
        extract(
            config(
                tiny_dirs, corpus, tmp_path / "err", model=str(poisoned), max_tokens=300, on_nonfinite="error"
            )
        )


# the other sources resume elastically through the same writer and deal as text: with --full (time)
@pytest.mark.parametrize(("source", "first", "then"), _for_every_source([(2, 1), (1, 2)], set()))
@pytest.mark.slow
def test_elastic_resume_with_another_number_of_processes(
    cases, references, server, tmp_path, source, first, then
):
    """Started by `first` processes, killed, finished by `then`: the rows of an uninterrupted run
    (before, image extraction refused torchrun)."""
    out = tmp_path / "store"
    after_shard_1 = "manifest-replace:2:after"
    run_elastic(server, cases[source].cli(out), first, then, kill_at=after_shard_1)
    assert_same_rows_as(out, references[source], first, then)
    finished = [s for s in open_store(out).manifest.shards if s.generation == 1]
    assert {s.rank for s in finished} == set(range(then))  # each rank of the second run wrote shards


@pytest.mark.slow
def test_cli_extract_and_inspect(tiny_dirs, corpus, tmp_path, capsys):
    from hookscope.cli import main

    out = tmp_path / "store"
    assert (
        main(
            [
                "extract",
                str(tiny_dirs["gpt2"]),
                "--out",
                str(out),
                "--data",
                str(corpus),
                "--context",
                "32",
                "--points",
                "blocks.*.resid_post",
                "--max-tokens",
                "500",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "rows" in capsys.readouterr().out
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    store = open_store(out)
    assert f"{len(store):,} rows" in text and "verified" in text
    for name in ("blocks.0.resid_post", "blocks.1.resid_post", "blocks.2.resid_post"):
        assert name in text
    # a damaged shard is caught by inspect
    shard = next((out / "shards").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["inspect", str(out)]) == 2
    assert shard.name in capsys.readouterr().err


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_settings_are_those_stores_were_made_with(tiny_dirs, cases, references):
    """A store's settings, key for key and in order, as b05e947's extract.settings_for wrote them:
    a store made before the sources room resumes (another hash would refuse it)."""
    loaded = hs.load(cases["text"].fields["model"])
    for source, extra in (("text", {}), ("generated", {"generate": 2})):
        case = cases[source]
        got = open_store(references[source]).manifest.settings
        assert list(got.items()) == list({**_settings_of(case, loaded), **extra}.items())


def _settings_of(case: Case, loaded: hs.Loaded) -> dict:
    corpus = Path(case.fields["data"])
    return {
        "model": case.fields["model"],
        "revision": None,
        "model_class": "GPT2LMHeadModel",
        "config_sha256": _sha256(loaded.model.config.to_json_string(use_diff=False).encode()),
        "tokenizer_sha256": _sha256(loaded.tokenizer.backend_tokenizer.to_str().encode()),
        "points": ["blocks.1.resid_post", "blocks.0.mlp.post"],
        "dtype": "float16",
        "context": 32,
        "batch_size": 4,
        "drop_bos": True,
        "packing": {
            "start": loaded.tokenizer.bos_token,
            "separator": loaded.tokenizer.eos_token,
            "rule": "start token opens every sequence; separator between documents",
        },
        "data": str(corpus),
        "data_fingerprint": {
            "kind": "file",
            "bytes": corpus.stat().st_size,
            "sha256": _sha256(corpus.read_bytes()),
        },
        "python": None,
        "text_field": "text",
    }
