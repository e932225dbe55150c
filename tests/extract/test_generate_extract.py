"""`hookscope extract --generate N`: each packed sequence's kept tokens, then the N tokens the model
generates after it, against plain `generate` + a teacher-forced forward with a plain hook; resumable
like any extraction (the same command again adds nothing), and a changed N is refused."""

from __future__ import annotations

import pytest
import torch
from helpers import corpus_fixture

import hookscope as hs
from hookscope.extract import ExtractConfig, extract
from hookscope.sources import batches, iter_documents, pack
from hookscope.store import open_store

NEW, CONTEXT, BATCH, MAX_TOKENS = 3, 16, 2, 96


corpus = corpus_fixture(30)


def cfg(tiny_dirs, corpus, out, **overrides) -> ExtractConfig:
    base = dict(
        out=str(out),
        model=str(tiny_dirs["gpt2"]),
        points=["blocks.1.resid_post"],
        data=str(corpus),
        context=CONTEXT,
        batch_size=BATCH,
        dtype="float32",
        max_tokens=MAX_TOKENS,
        progress=False,
        generate=NEW,
        shard_rows=40,
    )
    return ExtractConfig(**{**base, **overrides})


def test_extract_generate_stores_prompt_and_continuation(tiny_dirs, corpus, tmp_path):
    out = tmp_path / "store"
    first = extract(cfg(tiny_dirs, corpus, out))
    loaded = hs.load(str(tiny_dirs["gpt2"]))
    model, tok = loaded.model, loaded.tokenizer
    eos = model.generation_config.eos_token_id
    seen = {}
    handle = model.transformer.h[1].register_forward_hook(
        lambda m, a, o: seen.__setitem__("x", o[0] if isinstance(o, tuple) else o)
    )
    want_x, want_ids, want_docs, want_pos = [], [], [], []
    try:
        with torch.no_grad():
            packed = pack(iter_documents(str(corpus)), tok, context=CONTEXT, max_tokens=MAX_TOKENS)
            for batch in batches(packed, BATCH):
                assert batch["attention_mask"].all()  # full packed rows: no padding to move
                full = model.generate(
                    batch["input_ids"],
                    attention_mask=batch["attention_mask"],
                    max_new_tokens=NEW,
                    do_sample=False,
                    pad_token_id=eos,
                )
                assert full.shape[1] == CONTEXT + NEW  # this tiny model emits no EOS here
                model(full)  # teacher-forced: every position, the generated ones included
                keep = ~batch["special_mask"]
                for b in range(full.shape[0]):
                    want_x += [seen["x"][b, :CONTEXT][keep[b]], seen["x"][b, CONTEXT:]]
                    want_ids += [batch["input_ids"][b][keep[b]], full[b, CONTEXT:]]
                    last = int((batch["doc_ids"][b] >= 0).nonzero().max())
                    doc, pos = int(batch["doc_ids"][b, last]), int(batch["doc_positions"][b, last])
                    want_docs += [batch["doc_ids"][b][keep[b]], torch.full((NEW,), doc)]
                    want_pos += [batch["doc_positions"][b][keep[b]], pos + torch.arange(1, NEW + 1)]
    finally:
        handle.remove()
    store = open_store(out, verify=True)
    assert store.num_shards > 1
    assert torch.equal(store.tensor("token_ids"), torch.cat(want_ids))
    assert torch.equal(store.tensor("doc_ids"), torch.cat(want_docs))
    assert torch.equal(store.tensor("positions"), torch.cat(want_pos))
    torch.testing.assert_close(store.tensor("blocks.1.resid_post"), torch.cat(want_x), atol=1e-5, rtol=1e-4)
    assert store.manifest.settings["generate"] == NEW
    assert first.new_rows == len(store)

    again = extract(cfg(tiny_dirs, corpus, out))  # resumable: the same command again adds nothing
    assert again.new_rows == 0 and again.batches_skipped == first.batches_done
    with pytest.raises(hs.StoreError):
        extract(cfg(tiny_dirs, corpus, out, generate=NEW + 1))  # another N is another store
