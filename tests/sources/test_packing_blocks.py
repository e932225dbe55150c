"""Packing a block of sequences at a time (numpy, batched tokenizer calls, optional worker processes)
gives exactly the batches that packing token by token gave: the reference below is that per-token
packing, kept here as written before, so a store extracted today equals one extracted then."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
from helpers import corpus_fixture
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import hookscope.sources.text as text_source
from hookscope.errors import DataError
from hookscope.extract import ExtractConfig, extract
from hookscope.sources import batches, iter_documents, pack, pack_policy
from hookscope.sources.packing import pack_batches

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def corpus(n: int, seed: int) -> list[str]:
    """Documents of 0 to ~300 words (every 7th empty, one far longer than any context here)."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for i in range(n):
        words = 0 if i % 7 == 3 else int(torch.randint(1, 40 if i % 5 else 300, (1,), generator=g))
        idx = torch.randint(0, len(WORDS), (words,), generator=g).tolist()
        docs.append(" ".join(WORDS[j] for j in idx))
    docs[n // 2] = " ".join(WORDS * 200)  # ~2,400 tokens: spans many sequences
    return docs


def bpe(special: dict[str, str]) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=sorted(set(special.values())),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([" ".join(WORDS)] * 5, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **special)


TOKENIZERS = {  # start / separator: BOS = EOS (GPT-2), CLS + SEP (BERT), none at all
    "gpt2": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
    "bert": {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]"},
    "plain": {},
}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer(request) -> transformers.PreTrainedTokenizerFast:
    return bpe(TOKENIZERS[request.param])


# -- the reference: packing token by token, as before ----------------------------------------------


def reference_batches(
    documents, tokenizer, context, batch_size, *, bos="auto", drop_remainder=True, max_tokens=None
):
    policy = pack_policy(tokenizer, bos)
    lead = int(policy.start_id is not None)
    body = context - lead
    budget = max_tokens if max_tokens is not None else sys.maxsize
    ids, docs, positions, seqs = [], [], [], []
    seen = 0

    def sequence(ids, docs, positions):
        pad = context - lead - len(ids)
        return (
            torch.tensor([policy.start_id] * lead + ids + [policy.pad_id] * pad),
            torch.tensor([1] * (context - pad) + [0] * pad),
            torch.tensor([-1] * lead + docs + [-1] * pad),
            torch.tensor([-1] * lead + positions + [-1] * pad),
            torch.tensor([True] * lead + [d == -1 for d in docs] + [False] * pad),
        )

    for doc_id, doc in enumerate(documents):
        tokens = tokenizer(doc, add_special_tokens=False)["input_ids"]
        if not tokens:
            continue
        if seen and policy.separator_id is not None:
            ids, docs, positions = ids + [policy.separator_id], docs + [-1], positions + [-1]
        seen += len(tokens)
        ids, docs = ids + tokens, docs + [doc_id] * len(tokens)
        positions += range(len(tokens))
        while len(ids) >= body and budget >= context:
            seqs.append(sequence(ids[:body], docs[:body], positions[:body]))
            ids, docs, positions, budget = ids[body:], docs[body:], positions[body:], budget - context
        if budget < context and (drop_remainder or len(ids) >= budget - lead):
            break
    rest = min(len(ids), budget - lead)
    if not drop_remainder and rest > 0:
        seqs.append(sequence(ids[:rest], docs[:rest], positions[:rest]))
    if not seqs:
        raise DataError(
            f"the data gave {seen} tokens, not enough for one sequence of {context}"
            + (f" within max_tokens={max_tokens}" if max_tokens is not None else "")
            + "; add data, lower --context, or keep the remainder (drop_remainder=False)"
        )
    keys = ("input_ids", "attention_mask", "doc_ids", "doc_positions", "special_mask")
    out = []
    for at in range(0, len(seqs), batch_size):
        group = seqs[at : at + batch_size]
        batch = {k: torch.stack([s[i] for s in group]) for i, k in enumerate(keys)}
        batch["seq_ids"] = torch.arange(at, at + len(group))
        out.append(batch)
    return out


def assert_same(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert list(g) == list(w)
        for k in w:
            assert g[k].dtype == w[k].dtype and g[k].shape == w[k].shape, k
            assert torch.equal(g[k], w[k]), k


# -- the cases ------------------------------------------------------------------------------------

CASES = [  # context, batch size, keyword arguments, documents
    (16, 4, {}, 300),
    # one body token per sequence (with a start token): a sequence per token, so fewer documents
    (2, 3, {}, 60),
    (64, 8, {"bos": False}, 300),
    (16, 5, {"drop_remainder": False}, 300),
    (16, 4, {"max_tokens": 16 * 37 + 9}, 300),  # stops mid-document
    (16, 4, {"max_tokens": 16 * 37 + 9, "drop_remainder": False}, 300),
    (32, 1, {"max_tokens": 32 * 5}, 300),
    (16, 4, {"max_tokens": 9, "drop_remainder": False}, 300),  # less than one sequence, padded
    (512, 2, {}, 300),  # a context longer than most documents
]


@pytest.mark.parametrize("context, batch_size, kwargs, documents", CASES)
@pytest.mark.slow
def test_the_same_batches_as_packing_token_by_token(tokenizer, context, batch_size, kwargs, documents):
    docs = corpus(documents, seed=context)
    want = reference_batches(docs, tokenizer, context, batch_size, **kwargs)
    assert want  # every case packs at least one sequence
    assert_same(list(pack_batches(docs, tokenizer, context, batch_size, **kwargs)), want)
    assert_same(list(batches(pack(docs, tokenizer, context, **kwargs), batch_size)), want)


def test_files_and_directories_pack_as_before(tokenizer, tmp_path: Path):
    docs = corpus(200, seed=5)
    (tmp_path / "d" / "sub").mkdir(parents=True)
    with (tmp_path / "d" / "a.jsonl").open("w") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs[:120] if d)
    (tmp_path / "d" / "sub" / "b.txt").write_text("\n\n".join(d for d in docs[120:] if d))
    for source in (tmp_path / "d", tmp_path / "d" / "a.jsonl"):
        want = reference_batches(iter_documents(str(source)), tokenizer, 24, 3, max_tokens=24 * 50)
        assert_same(
            list(pack_batches(iter_documents(str(source)), tokenizer, 24, 3, max_tokens=24 * 50)), want
        )


class Counted:
    def __init__(self, docs):
        self.docs, self.read = docs, 0

    def __iter__(self):
        for d in self.docs:
            self.read += 1
            yield d


@pytest.mark.parametrize("kwargs", [{"max_tokens": 16 * 3}, {"max_tokens": 40, "drop_remainder": False}])
def test_a_spent_budget_reads_no_further_chunk(tokenizer, kwargs):
    docs = Counted(corpus(1000, seed=1))
    list(pack_batches(docs, tokenizer, 16, 4, **kwargs))
    assert docs.read == 64  # the first tokenizer call's documents, not the other 936


def test_too_little_data_is_the_same_error(tokenizer):
    docs = ["alpha beta", "", "gamma"]
    with pytest.raises(DataError) as want:
        reference_batches(docs, tokenizer, 64, 2)
    with pytest.raises(DataError) as got:
        list(pack_batches(docs, tokenizer, 64, 2))
    assert str(got.value) == str(want.value)


def test_worker_processes_give_the_same_batches(tokenizer):
    docs = corpus(400, seed=9)
    want = list(pack_batches(docs, tokenizer, 16, 4, max_tokens=16 * 300 + 5, drop_remainder=False))
    got = list(pack_batches(docs, tokenizer, 16, 4, max_tokens=16 * 300 + 5, drop_remainder=False, workers=2))
    assert_same(got, want)


# -- a store: the same bytes as a store written from the per-token packing's batches ---------------

corpus_file = corpus_fixture(80)


def store_files(out: Path) -> dict[str, bytes]:
    """Every file of a store but its run journal's timings: the shards' bytes and the manifest."""
    files = {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    manifest = json.loads(files.pop("manifest.json"))
    for key in ("created", "updated", "runs", "seconds"):
        manifest.pop(key, None)
    return {**files, "manifest.json": json.dumps(manifest, sort_keys=True).encode()}


@pytest.mark.parametrize("keep_bos, max_tokens", [(False, None), (True, 32 * 4 * 5 + 40)])
@pytest.mark.slow
def test_a_store_is_the_bytes_the_per_token_packing_wrote(
    tiny_dirs, corpus_file, tmp_path, monkeypatch, keep_bos, max_tokens
):
    def cfg(out: Path, workers: int = 0) -> ExtractConfig:
        return ExtractConfig(
            out=str(out),
            model=str(tiny_dirs["gpt2"]),
            points=["blocks.1.resid_post"],
            data=str(corpus_file),
            context=32,
            batch_size=4,
            dtype="float32",
            shard_rows=100,
            drop_bos=not keep_bos,
            max_tokens=max_tokens,
            progress=False,
            workers=workers,
        )

    extract(cfg(tmp_path / "new"))
    extract(cfg(tmp_path / "workers", workers=2))
    with monkeypatch.context() as m:
        m.setattr(
            text_source,
            "pack_batches",
            lambda docs, tok, context, batch_size, max_tokens, workers: iter(
                reference_batches(docs, tok, context, batch_size, max_tokens=max_tokens)
            ),
        )
        extract(cfg(tmp_path / "old"))
    old = store_files(tmp_path / "old")
    assert len([name for name in old if name.startswith("shards/")]) > 2
    assert store_files(tmp_path / "new") == old
    assert store_files(tmp_path / "workers") == old
