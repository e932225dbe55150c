"""`hookscope extract --engine vllm` against vLLM's own plain prefill and hookscope's Hugging Face
extraction of the same model and corpus, side by side in one process.

    .venv-vllm/bin/python bench/bench_vllm_extract.py [--sequences 256] [--context 128] [--rounds 3]

A tiny random Llama (d_model 256, 4 heads, 2 layers; save_pretrained to a temporary directory) and
a generated text corpus packed by hookscope's text source; one engine (vLLM's default layout,
float32, eager, prefix caching off, `max_model_len` context + 1: what `--engine vllm` makes), shared
by the two vLLM cases. Per round, taking turns: plain `llm.generate(sequences, max_tokens=1)` on the
packed sequences (the prefill work alone, nothing kept); `hs.extract(ExtractConfig(engine=llm))`
(capture, rows, store written; its own time, after the store is opened); `hs.extract` on Hugging
Face in this process (the same, after the model is loaded). Tokens/s over the packed tokens;
medians. Prints one line per case.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "engines"))

POINT = "blocks.1.resid_post"


def corpus(path: Path, sequences: int, context: int) -> Path:
    import torch

    words = "the a fox dog ran over under river stone light small large quick slow".split()
    g = torch.Generator().manual_seed(0)
    picks = torch.randint(0, len(words), (sequences * context,), generator=g).tolist()
    per_doc = 4 * context  # words; a word is one or more tokens: enough text for `sequences`
    docs = [" ".join(words[j] for j in picks[i : i + per_doc]) for i in range(0, len(picks), per_doc)]
    path.write_text("\n\n".join(docs))
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from vllm import SamplingParams
    from vllm_models import save

    import hookscope as hs
    from hookscope.engines import vllm as hv
    from hookscope.loading import load
    from hookscope.sources.documents import iter_documents
    from hookscope.sources.packing import pack_batches

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = save("llama", root / "llama")
        data = corpus(root / "corpus.txt", args.sequences, args.context)
        tokenizer = load(str(model), device="meta").tokenizer
        batches = list(pack_batches(iter_documents(str(data)), tokenizer, context=args.context, batch_size=8))
        sequences = [
            {"prompt_token_ids": ids[mask.bool()].tolist()}
            for b in batches
            for ids, mask in zip(b["input_ids"], b["attention_mask"], strict=True)
        ][: args.sequences]
        max_tokens = len(sequences) * args.context
        tokens = sum(len(s["prompt_token_ids"]) for s in sequences)
        llm = hv.llm(str(model), max_model_len=args.context + 1, enable_prefix_caching=False)
        plain = SamplingParams(max_tokens=1, detokenize=False)

        def extract(engine, n: int) -> float:
            cfg = hs.ExtractConfig(
                out=str(root / f"store-{n}"),
                model=str(model),
                points=[POINT],
                data=str(data),
                context=args.context,
                batch_size=8,
                dtype="float32",
                max_tokens=max_tokens,
                progress=False,
                engine=engine,
            )
            return hs.extract(cfg).seconds

        def timed(run) -> float:
            start = time.perf_counter()
            run()
            return time.perf_counter() - start

        cases = {
            "vLLM plain generate(max_tokens=1)": lambda n: timed(
                lambda: llm.generate(sequences, plain, use_tqdm=False)
            ),
            f"hookscope extract --engine vllm ({POINT})": lambda n: extract(llm, n),
            f"hookscope extract, Hugging Face ({POINT})": lambda n: extract(None, n),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        n = 0
        for round_ in range(args.rounds + 1):  # the first round warms up
            for name, run in cases.items():
                n += 1
                took = run(n)
                if round_:
                    times[name].append(took)
        hv.shut_down(llm)  # the core given time to remove its shared memory
    load_now = os.getloadavg()[0]
    print(f"{len(sequences)} sequences, {tokens:,} tokens, {args.rounds} rounds, load {load_now:.1f}")
    base = statistics.median(times["vLLM plain generate(max_tokens=1)"])
    for name, runs in times.items():
        median = statistics.median(runs)
        rate = f"{tokens / median:,.0f} tokens/s"
        print(f"{name}: {median * 1e3:.1f} ms, {rate}, {base / median:.2f}x plain prefill")


if __name__ == "__main__":
    main()
