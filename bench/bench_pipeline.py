"""The extraction pipeline against its floors, on the CPU (issue 34): is hookscope's own work ever
what bounds an extraction?

(a) writer: `ShardWriter` fed 32,768 x 768 bf16 batches as the loop feeds them (the per-row
    columns beside them, and the statistics the executor computed, where the writer takes them),
    against writing the same bytes into files of the same size in the same directory, fsynced
    ("raw"). Both in a memory-backed directory (/dev/shm) and in a disk directory (/tmp).
(b) extraction with a free forward: `extract()` of point `embed` of a GPT-2-small shape (1M tokens,
    32 x 1024 bf16, store in /dev/shm) against the packing alone (the same documents tokenized and
    packed into the same batches in one thread), and the same with 12 points (embed and
    blocks.0-10.resid_post) where every block is replaced by the identity, so that the forward stays
    free and only hookscope's own work is left. Beside them: the model stage alone (the forward
    and captures on batches packed already) and its floor here, the bare embedding lookup on the
    same batches (THP_MEM_ALLOC_ENABLE=1 unless it is set, as `hookscope extract` does: the figures name it).
    OMP_WAIT_POLICY=PASSIVE unless it is set, as the `hookscope` command runs; `--wait-policy default`
    leaves it unset (torch's own: idle OpenMP threads spin a while). The figures name it.

    python bench/bench_pipeline.py                 # 3 fresh processes per figure, medians
    python bench/bench_pipeline.py --smoke         # tiny, seconds
    python bench/bench_pipeline.py --only writer   # or: extract, data
    python bench/bench_pipeline.py --only data --workers 2

(c) the data stage alone (`--only data`): reading, tokenizing and packing the corpus of (b) into its
    batches (`pack_batches`, with `--workers` processes), against the tokenizer alone (the same
    tokenizer calls, on documents read already), on long documents (2,048 words) and on short ones
    (1-120 words).

Every figure is the median over fresh processes of a ratio taken inside one process (the floor
measured beside the measure), so the machine's load weighs on both sides alike.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from disk_floors import direct_write_s, raw_parts, raw_write_s

MEMORY_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
DISK_DIR = Path(tempfile.gettempdir())
WORDS = (
    "the residual stream of a transformer carries features between layers while sparse "
    "autoencoders read them back from a store of activations written by the pipeline"
).split()


# --- (a) the writer ----------------------------------------------------------------------------


def writer_run(args: argparse.Namespace) -> dict[str, float]:
    import torch

    from hookscope.store import PointStats
    from hookscope.store.writer import ShardWriter

    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    point = "blocks.6.resid_post"
    batches = [
        torch.randn(args.rows, args.width, generator=g).to(torch.bfloat16) for _ in range(args.batches)
    ]
    metas = [
        {
            name: torch.arange(i * args.rows, (i + 1) * args.rows)
            for name in ("token_ids", "doc_ids", "positions", "seq_ids")
        }
        for i in range(args.batches)
    ]
    takes_stats = "stats" in inspect.signature(ShardWriter.write).parameters
    stats = [{point: PointStats.of(b)} for b in batches] if takes_stats else [None] * len(batches)
    # the raw floor writes the same bytes: each batch's activations, then its columns
    chunks = [
        memoryview(t.contiguous().view(torch.uint8).numpy())
        for b, m in zip(batches, metas, strict=True)
        for t in (b, *m.values())
    ]
    total = sum(c.nbytes for c in chunks)
    shard_bytes = total * args.shard_rows // (args.rows * args.batches)
    out: dict[str, float] = {"bytes": total}
    base = Path(tempfile.mkdtemp(prefix="hookscope-bench-writer-", dir=args.dir))
    try:
        for attempt in range(2):  # the first round touches fresh pages: the second is the figure
            raw_s = raw_write_s(base, chunks, shard_bytes)
            direct_s = direct_write_s(base, total, shard_bytes)  # the disk's own: no page cache
            store = base / f"store-{attempt}"
            start = time.perf_counter()
            with ShardWriter(store, {"bench": 1}, shard_rows=args.shard_rows) as writer:
                for i, (b, m, s) in enumerate(zip(batches, metas, stats, strict=True)):
                    if takes_stats:
                        writer.write(i, {point: b}, m, stats=s)
                    else:
                        writer.write(i, {point: b}, m)
            writer_s = time.perf_counter() - start
            shutil.rmtree(store)
        out.update(raw_s=raw_s, direct_s=direct_s, writer_s=writer_s, takes_stats=float(takes_stats))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return out


# --- (b) extraction with a free forward --------------------------------------------------------


def prepare(work: Path, docs: int, words_per_doc: int, points: int) -> None:
    """A GPT-2-small-shaped checkpoint (seeded) and a JSON-lines corpus, made once per run."""
    import torch

    from hookscope.testing import gpt2_small_config, train_tokenizer

    if not (work / "model" / "ready").exists():
        from transformers import GPT2LMHeadModel

        torch.manual_seed(0)
        tokenizer = train_tokenizer(4096)
        cfg = gpt2_small_config(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        if points == 1:
            cfg.n_layer = 1  # only the embeddings are read (points=); fewer bytes to save
        GPT2LMHeadModel(cfg).eval().save_pretrained(work / "model")
        tokenizer.save_pretrained(work / "model")
        (work / "model" / "ready").write_text("ok\n")
    g = torch.Generator().manual_seed(0)
    with (work / "corpus.jsonl").open("w") as f:
        for _ in range(docs):
            idx = torch.randint(0, len(WORDS), (words_per_doc,), generator=g).tolist()
            f.write(json.dumps({"text": " ".join(WORDS[i] for i in idx)}) + "\n")


def identity_blocks() -> None:
    """Every GPT-2 block returns its input: a forward through them costs nothing."""
    from transformers.models.gpt2 import modeling_gpt2

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states

    modeling_gpt2.GPT2Block.forward = forward


def extract_run(args: argparse.Namespace) -> dict[str, float]:
    import torch
    import transformers
    from transformers import AutoTokenizer

    import hookscope as hs
    from hookscope.capture import Capture
    from hookscope.extract import ExtractConfig, extract
    from hookscope.sources import iter_documents
    from hookscope.sources.packing import pack_batches

    torch.set_num_threads(2)
    transformers.logging.set_verbosity_error()
    work = Path(args.work)
    points = ["embed"] + [f"blocks.{i}.resid_post" for i in range(args.points - 1)]
    if args.points > 1:
        identity_blocks()
    store = Path(tempfile.mkdtemp(prefix="hookscope-bench-store-", dir=args.store_dir or MEMORY_DIR))
    try:
        cfg = ExtractConfig(
            out=str(store / "s"),
            model=str(work / "model"),
            points=points,
            data=str(work / "corpus.jsonl"),
            context=args.context,
            batch_size=args.batch,
            dtype="bfloat16",
            max_tokens=args.tokens,
            progress=False,
            shard_rows=args.shard_rows,
            **({"workers": args.workers} if args.workers else {}),
        )
        summary = extract(cfg)
        extract_s = summary.seconds
        rows, nbytes = summary.new_rows, summary.bytes_written
        shards = len(list((store / "s" / "shards").glob("*.safetensors")))
        shutil.rmtree(store / "s")  # its room, for the floor's copy (a long run fills a disk twice)
        # the store's own floor: the same bytes written raw into files of the shards' size, in the
        # same directory, each fsynced (in memory, the memory's own copy of them)
        raw_s = raw_write_s(store, raw_parts(nbytes, -(-nbytes // shards)), -(-nbytes // shards))
        direct_s = direct_write_s(store, nbytes, -(-nbytes // shards))  # the disk's own: no page cache
    finally:
        shutil.rmtree(store, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    start = time.perf_counter()
    packed = list(
        pack_batches(
            iter_documents(str(work / "corpus.jsonl")),
            tokenizer,
            args.context,
            args.batch,
            max_tokens=args.tokens,
            workers=args.workers,
        )
    )
    pack_s = time.perf_counter() - start
    tokens = len(packed) * args.batch * args.context
    # the model stage alone: the same forward and captures as the extraction's, on batches packed already
    loaded = hs.load(str(work / "model"), points=points)
    start = time.perf_counter()
    for b in packed:
        keep = b["attention_mask"].bool() & ~b["special_mask"].bool()
        with Capture(loaded.model, points, token_mask=keep, dtype=torch.bfloat16) as cap:
            cap.run({"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]})
            [cap[p] for p in points]
    model_s = time.perf_counter() - start
    # the model stage's floor here: the bare embedding lookup on the same batches (every point is
    # at or after it, and the blocks are free), its output made and dropped as the forward's is
    embedding = loaded.model.get_input_embeddings()
    start = time.perf_counter()
    with torch.inference_mode():
        for b in packed:
            embedding(b["input_ids"])
    embed_s = time.perf_counter() - start
    return {
        "tokens": tokens,
        "rows": rows,
        "bytes": nbytes,
        "extract_s": extract_s,
        "pack_s": pack_s,
        "raw_s": raw_s,
        "direct_s": direct_s,
        "model_s": model_s,
        "embed_s": embed_s,
        "summary": str(summary),
        "huge_pages": os.environ.get("THP_MEM_ALLOC_ENABLE", ""),
        "wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
    }


# --- (c) the data stage alone --------------------------------------------------------------------


def data_run(args: argparse.Namespace) -> dict[str, float]:
    import torch
    from transformers import AutoTokenizer

    from hookscope.sources import iter_documents
    from hookscope.sources.packing import pack_batches
    from hookscope.sources.tokenize import tokenized

    torch.set_num_threads(2)
    corpus = str(Path(args.work) / args.corpus)
    tokenizer = AutoTokenizer.from_pretrained(Path(args.work) / "model")
    start = time.perf_counter()
    tokens = sum(
        b["input_ids"].numel()
        for b in pack_batches(
            iter_documents(corpus), tokenizer, args.context, args.batch, workers=args.workers
        )
    )
    pack_s = time.perf_counter() - start
    docs = list(iter_documents(corpus))
    start = time.perf_counter()
    floor = sum(len(ids) for _, ids, _ in tokenized(docs, tokenizer))
    return {
        "tokens": tokens,
        "pack_s": pack_s,
        "floor_tokens": floor,
        "tokenize_s": time.perf_counter() - start,
    }


def short_documents(work: Path, words: int) -> None:
    import torch

    g = torch.Generator().manual_seed(1)
    with (work / "short.jsonl").open("w") as f:
        while words > 0:
            n = int(torch.randint(1, 121, (1,), generator=g))
            idx = torch.randint(0, len(WORDS), (n,), generator=g).tolist()
            f.write(json.dumps({"text": " ".join(WORDS[i] for i in idx)}) + "\n")
            words -= n


# --- the driver ---------------------------------------------------------------------------------


def fresh(mode: str, extra: list[str], runs: int) -> list[dict]:
    out = []
    for _ in range(runs):
        done = subprocess.run(
            [sys.executable, __file__, "--child", mode, *extra], capture_output=True, text=True, timeout=1800
        )
        if done.returncode:
            raise SystemExit(f"child {mode} {extra} failed:\n{done.stderr[-4000:]}")
        out.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return out


def load() -> str:
    return "load " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as `hookscope extract` runs; workers inherit it
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--only", choices=("writer", "extract", "data"))
    p.add_argument("--workers", type=int, default=0, help="tokenizer processes (extract --workers)")
    p.add_argument("--corpus", default="corpus.jsonl", help=argparse.SUPPRESS)
    p.add_argument("--rows", type=int, default=32768)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--shard-rows", type=int, default=65536)
    p.add_argument("--tokens", type=int, default=2**20, help="tokens of the one-point extraction")
    p.add_argument("--tokens-12", type=int, default=2**17, help="tokens of the 12-point extraction")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--store-dir", help=f"where (b) puts its store (default {MEMORY_DIR}; e.g. /tmp: a disk)")
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--points", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument(
        "--wait-policy",
        choices=("PASSIVE", "default"),
        default="PASSIVE",
        help="OMP_WAIT_POLICY of the children when it is not set: PASSIVE as the `hookscope` "
        "command runs (src/_hookscope_cli.py), or left unset",
    )
    args = p.parse_args()
    if args.wait_policy == "PASSIVE" and not args.child:  # children inherit it; torch reads it as it loads
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if args.child == "writer":
        print(json.dumps(writer_run(args)))
        return
    if args.child == "extract":
        print(json.dumps(extract_run(args)))
        return
    if args.child == "data":
        print(json.dumps(data_run(args)))
        return
    if args.smoke:
        args.runs, args.rows, args.width, args.batches, args.shard_rows = 1, 256, 64, 4, 512
        args.tokens, args.tokens_12, args.context, args.batch = 4096, 2048, 128, 4
    shape = [
        "--rows",
        str(args.rows),
        "--width",
        str(args.width),
        "--batches",
        str(args.batches),
        "--shard-rows",
        str(args.shard_rows),
    ]
    print(f"bench_pipeline: {args.runs} fresh processes per figure, medians; {load()}", flush=True)
    if args.only in (None, "writer"):
        for name, folder in (("memory", MEMORY_DIR), ("disk", DISK_DIR)):
            rs = fresh("writer", [*shape, "--dir", str(folder)], args.runs)
            ratio = statistics.median(r["raw_s"] / r["writer_s"] for r in rs)
            mb = rs[0]["bytes"] / 1e6
            print(
                f"(a) writer, {args.batches} x {args.rows} x {args.width} bf16 + 4 int64 columns, "
                f"{args.shard_rows}-row shards, {name} ({folder}): writer "
                f"{statistics.median(mb / r['writer_s'] for r in rs):,.0f} MB/s, raw fsynced write "
                f"{statistics.median(mb / r['raw_s'] for r in rs):,.0f} MB/s: {ratio:.2f}x "
                f"(target >= 0.5x in memory)"
                f"{'' if rs[0]['takes_stats'] else ', stats computed by the writer'}; "
                f"{load()}",
                flush=True,
            )
            if rs[0].get("direct_s"):
                print(
                    f"    the same bytes written with O_DIRECT, fsynced: "
                    f"{statistics.median(mb / r['direct_s'] for r in rs):,.0f} MB/s; the writer "
                    f"{statistics.median(r['direct_s'] / r['writer_s'] for r in rs):.2f}x that",
                    flush=True,
                )
    if args.only in (None, "extract"):
        with tempfile.TemporaryDirectory(prefix="hookscope-bench-pipeline-") as tmp:
            for n, tokens in ((1, args.tokens), (12, args.tokens_12)):
                work = Path(tmp) / f"p{n}"
                work.mkdir()
                words = tokens * 11 // 10 + 4096
                prepare(work, docs=max(4, words // 2048), words_per_doc=min(2048, words), points=n)
                rs = fresh(
                    "extract",
                    [
                        "--work",
                        str(work),
                        "--points",
                        str(n),
                        "--tokens",
                        str(tokens),
                        "--context",
                        str(args.context),
                        "--batch",
                        str(args.batch),
                        "--shard-rows",
                        str(args.shard_rows),
                        "--workers",
                        str(args.workers),
                        *(["--store-dir", args.store_dir] if args.store_dir else []),
                    ],
                    args.runs,
                )
                ratio = statistics.median(r["pack_s"] / r["extract_s"] for r in rs)
                ext = statistics.median(r["rows"] / r["extract_s"] for r in rs)
                pk = statistics.median(r["tokens"] / r["pack_s"] for r in rs)
                mbs = statistics.median(r["bytes"] / r["extract_s"] / 1e6 for r in rs)
                md = statistics.median(r["tokens"] / r["model_s"] for r in rs)
                both = statistics.median(max(r["pack_s"], r["model_s"]) / r["extract_s"] for r in rs)
                print(
                    f"(b) extract, free forward, {n} point(s), {rs[0]['tokens']:,} tokens "
                    f"({args.batch} x {args.context} bf16, store in {args.store_dir or MEMORY_DIR}, "
                    f"--workers {args.workers}): "
                    f"{ext:,.0f} tokens/s (runs "
                    + " / ".join(f"{r['rows'] / r['extract_s']:,.0f}" for r in rs)
                    + f"; {mbs:,.0f} MB/s) vs packing alone {pk:,.0f} tokens/s: {ratio:.2f}x "
                    "(target >= 0.6x); "
                    f"{load()}",
                    flush=True,
                )
                print(
                    f"    the model stage alone (forward + captures on batches packed already): "
                    f"{md:,.0f} tokens/s; extract / the slower of packing and the model stage: {both:.2f}x",
                    flush=True,
                )
                if "embed_s" in rs[0]:
                    em = statistics.median(r["tokens"] / r["embed_s"] for r in rs)
                    floor = statistics.median(max(r["pack_s"], r["embed_s"]) / r["extract_s"] for r in rs)
                    print(
                        f"    the model stage's floor, the bare embedding lookup on the same batches: "
                        f"{em:,.0f} tokens/s; extract / the slower of packing and that floor: {floor:.2f}x "
                        f"(THP_MEM_ALLOC_ENABLE={rs[0]['huge_pages'] or 'unset'}, "
                        f"OMP_WAIT_POLICY={rs[0].get('wait_policy', 'unset')})",
                        flush=True,
                    )
                for key, words in (
                    (
                        "raw_s",
                        "the store's floor, its bytes written raw into the same "
                        "directory (files of the shards' size, fsynced)",
                    ),
                    (
                        "direct_s",
                        "the disk's own rate, the same bytes written with O_DIRECT "
                        "(files of the shards' size, fsynced)",
                    ),
                ):
                    if not rs[0].get(key):  # no O_DIRECT where the filesystem refuses it
                        continue
                    rate = statistics.median(r["rows"] / r[key] for r in rs)
                    lower = statistics.median(
                        r["rows"] / r["extract_s"] / min(r["tokens"] / r["pack_s"], r["rows"] / r[key])
                        for r in rs
                    )
                    print(
                        f"    {words}: {rate:,.0f} rows/s; extract / the lower of packing and that: "
                        f"{lower:.2f}x",
                        flush=True,
                    )
                print("    last run's summary: " + rs[-1]["summary"].replace("\n", "\n    "), flush=True)
    if args.only == "data":
        with tempfile.TemporaryDirectory(prefix="hookscope-bench-data-") as tmp:
            work = Path(tmp)
            words = args.tokens * 11 // 10 + 4096
            prepare(work, docs=max(4, words // 2048), words_per_doc=min(2048, words), points=1)
            short_documents(work, words)
            for corpus, what in (
                ("corpus.jsonl", "2,048-word documents"),
                ("short.jsonl", "1-120-word documents"),
            ):
                rs = fresh(
                    "data",
                    [
                        "--work",
                        str(work),
                        "--corpus",
                        corpus,
                        "--context",
                        str(args.context),
                        "--batch",
                        str(args.batch),
                        "--workers",
                        str(args.workers),
                    ],
                    args.runs,
                )
                pk = statistics.median(r["tokens"] / r["pack_s"] for r in rs)
                tk = statistics.median(r["floor_tokens"] / r["tokenize_s"] for r in rs)
                ratio = statistics.median(
                    r["tokens"] / r["pack_s"] / (r["floor_tokens"] / r["tokenize_s"]) for r in rs
                )
                print(
                    f"(c) the data stage alone, {what}, {rs[0]['tokens']:,} tokens packed ({args.batch} x "
                    f"{args.context}, --workers {args.workers}): reading + tokenizing + packing {pk:,.0f} "
                    f"tokens/s vs the tokenizer alone {tk:,.0f} tokens/s: {ratio:.2f}x; {load()}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
