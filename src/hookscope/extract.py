"""The extraction pipeline: text -> packed token batches -> capture -> sharded store.

One forward pass per batch captures every point (stopped after the last one); the writer thread
turns captures into shards while the next batch computes. Re-running the same command resumes:
batches already committed to the manifest are skipped, exactly once. Under `torchrun`, batch i
goes to rank i % world_size; each rank writes its own shards and rank 0 merges the manifests.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .capture import Capture
from .data import batches, iter_documents, pack, pack_policy
from .errors import HookscopeError
from .models import load
from .store import ShardWriter, merge_rank_manifests

DEFAULT_DATA = "builtin:stdlib-docstrings"
DEFAULT_POINT = "blocks.3.resid_post"


@dataclass
class ExtractConfig:
    out: str
    model: str | None = None
    points: list[str] = field(default_factory=lambda: [DEFAULT_POINT])
    data: str = DEFAULT_DATA
    text_field: str = "text"
    context: int = 128
    batch_size: int = 8
    dtype: str = "float16"
    drop_bos: bool = True
    max_tokens: int | None = None
    device: str = "cpu"
    device_map: str | None = None  # "auto": spread a big model over the devices (accelerate)
    shard_rows: int = 65536
    on_nonfinite: str = "warn"  # "warn" | "error"
    revision: str | None = None
    progress: bool = True
    generate: int = 0  # --generate N: also store N greedy tokens after each sequence (generate.py)


@dataclass
class ExtractSummary:
    out: str
    rows: int
    new_rows: int
    batches_done: int
    batches_skipped: int
    seconds: float
    bytes_written: int
    nonfinite: dict[str, int]

    def __str__(self) -> str:
        rate = self.new_rows / self.seconds if self.seconds > 0 else 0.0
        lines = [
            f"wrote {self.new_rows:,} rows in {self.seconds:.1f} s ({rate:,.0f} tokens/s, "
            f"{self.bytes_written / 2**20:,.1f} MiB); store holds {self.rows:,} rows -> {self.out}",
        ]
        if self.batches_skipped:
            lines.append(f"resumed: skipped {self.batches_skipped} batches already on disk")
        bad = {k: v for k, v in self.nonfinite.items() if v}
        if bad:
            lines.append("non-finite values (NaN/Inf) per point: "
                         + ", ".join(f"{k}: {v}" for k, v in bad.items()))
        return "\n".join(lines)


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _tokenizer_hash(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return _sha256_text(text)


def settings_for(cfg: ExtractConfig, loaded, points: list[str], world_size: int) -> dict:
    """Everything that shapes the stored rows: a store made with other settings is refused."""
    return {
        "model": loaded.name,
        "revision": cfg.revision,
        "model_class": type(loaded.model).__name__,
        "config_sha256": _sha256_text(loaded.model.config.to_json_string(use_diff=False)),
        "tokenizer_sha256": _tokenizer_hash(loaded.tokenizer),
        "points": points,
        "dtype": cfg.dtype,
        "context": cfg.context,
        "batch_size": cfg.batch_size,
        "drop_bos": cfg.drop_bos,
        "packing": pack_policy(loaded.tokenizer).as_dict(),
        "data": cfg.data,
        # the builtin corpus is this Python's own docstrings: another version, another corpus
        "python": list(sys.version_info[:2]) if cfg.data.startswith("builtin:") else None,
        "text_field": cfg.text_field,
        "world_size": world_size,
        **({"generate": cfg.generate} if cfg.generate else {}),  # absent: stores made before keep their hash
    }


_POSITION_TABLES = ("wpe", "position_embeddings", "embed_positions")  # GPT-2, BERT, OPT-like


def max_positions(model: torch.nn.Module) -> int | None:
    """The longest input a model with a learned position-embedding table takes; None for rotary or
    relative positions, which have no hard limit."""
    if not any(name.rsplit(".", 1)[-1] in _POSITION_TABLES and isinstance(m, torch.nn.Embedding)
               for name, m in model.named_modules()):
        return None
    config = getattr(model, "config", None)
    for key in ("n_positions", "max_position_embeddings"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def _dist_info() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _init_distributed(world_size: int, device: str) -> None:
    import torch.distributed as dist

    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")


def extract(cfg: ExtractConfig) -> ExtractSummary:
    """Run the pipeline described by `cfg`; see the module docstring."""
    if cfg.on_nonfinite not in ("warn", "error"):
        raise HookscopeError(f"on_nonfinite={cfg.on_nonfinite!r}: use 'warn' or 'error'")
    rank, world_size = _dist_info()
    _init_distributed(world_size, cfg.device)
    device = (f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cfg.device == "cuda" and world_size > 1
              else cfg.device)
    loaded = load(cfg.model, device=device, revision=cfg.revision, device_map=cfg.device_map)
    if cfg.device_map is not None:  # inputs go where the embeddings live
        device = str(loaded.model.get_input_embeddings().weight.device)
    dtype = getattr(torch, cfg.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise HookscopeError(f"unknown dtype {cfg.dtype!r}: use float32, float16 or bfloat16")
    points = [s.name for s in loaded.arch.resolve(cfg.points)]  # unknown names fail before any work
    longest = max_positions(loaded.model)
    if longest is not None and cfg.context > longest:
        raise HookscopeError(f"context {cfg.context} is longer than the model's {longest} positions; use "
                             f"--context {longest} or less")
    if cfg.generate and longest is not None and cfg.context + cfg.generate > longest:
        raise HookscopeError(f"--context {cfg.context} + --generate {cfg.generate} is longer than the "
                             f"model's {longest} positions; lower one of them")

    settings = settings_for(cfg, loaded, points, world_size)
    documents = iter_documents(cfg.data, text_field=cfg.text_field)
    sequences = pack(documents, loaded.tokenizer, context=cfg.context, max_tokens=cfg.max_tokens)
    started = time.perf_counter()
    done = skipped = new_rows = 0
    progress = _Progress(cfg.progress and rank == 0, cfg.max_tokens)
    with ShardWriter(cfg.out, settings, shard_rows=cfg.shard_rows, rank=rank,
                     world_size=world_size) as writer:
        for index, batch in enumerate(batches(sequences, cfg.batch_size)):
            if index % world_size != rank:
                continue
            if index in writer.done_batches:
                skipped += 1
                progress.update(int(batch["attention_mask"].sum()), writer.bytes_written)
                continue
            keep = batch["attention_mask"].bool()
            if cfg.drop_bos:
                keep &= ~batch["special_mask"].bool()
            inputs = {"input_ids": batch["input_ids"].to(device),
                      "attention_mask": batch["attention_mask"].to(device)}
            if cfg.generate:  # the model's own continuations: prompt + generated rows per sequence
                from .generate import generate_rows

                acts, meta = generate_rows(loaded.model, {**batch, **inputs}, points, cfg.generate,
                                           keep.to(device), dtype=dtype)
            else:
                with Capture(loaded.model, points, token_mask=keep.to(device), dtype=dtype,
                             device="cpu") as cap:
                    cap.run(inputs)
                    acts = {name: cap[name] for name in points}
                meta = {
                    "token_ids": batch["input_ids"][keep],
                    "doc_ids": batch["doc_ids"][keep],
                    "positions": batch["doc_positions"][keep],
                    "seq_ids": batch["seq_ids"].unsqueeze(1).expand_as(keep)[keep],
                }
            _check_finite(acts, cfg.on_nonfinite, index)
            writer.write(index, acts, meta)
            done += 1
            new_rows += len(meta["token_ids"])
            progress.update(int(batch["attention_mask"].sum()), writer.bytes_written)
        writer.close()
        total_rows = writer.total_rows
        nonfinite = dict(writer.nonfinite)
        bytes_written = writer.bytes_written
    progress.close()
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()
        if rank == 0:
            merge_rank_manifests(cfg.out, world_size)
        dist.barrier()
    return ExtractSummary(cfg.out, total_rows, new_rows, done, skipped, time.perf_counter() - started,
                          bytes_written, nonfinite)


def _check_finite(acts: dict[str, torch.Tensor], policy: str, index: int) -> None:
    if policy != "error":
        return  # the writer counts them per point; the summary reports them
    for name, act in acts.items():
        if not torch.isfinite(act).all():
            bad = int((~torch.isfinite(act)).sum())
            raise HookscopeError(
                f"batch {index}: {bad} non-finite values (NaN/Inf) at {name}; nothing of this batch was "
                "written (earlier batches are safe). Re-run with --on-nonfinite warn to keep them"
            )


class _Progress:
    """tqdm bar in tokens (tokens/s, ETA when a token budget is known, MiB written)."""

    def __init__(self, enabled: bool, total_tokens: int | None):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_tokens, unit="tok", unit_scale=True, desc="extract",
                            dynamic_ncols=True)

    def update(self, tokens: int, bytes_written: int) -> None:
        if self.bar is not None:
            self.bar.update(tokens)
            self.bar.set_postfix_str(f"{bytes_written / 2**20:,.1f} MiB", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
