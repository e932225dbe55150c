"""The extraction pipeline: text -> packed token batches -> capture -> sharded store.

One forward pass per batch captures every point (stopped after the last one); the writer thread
turns captures into shards while the next batch computes. Re-running the same command resumes:
batches already committed to the manifest are skipped, exactly once. Under `torchrun`, batch i
goes to rank i % world_size; each rank writes its own shards and rank 0 merges the manifests. A
resume may use another number of processes: the batches not yet committed are dealt among them
(store/resume.py), and the finished store holds the same rows.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .capture import Capture
from .data import ReadMeter, batches, iter_documents, pack, pack_policy, source_chars, source_fingerprint
from .errors import DataError, HookscopeError, StoreError
from .images import extract_images, is_image_source
from .inputs import max_positions
from .models import load, tokenizer_hash
from .store import ShardWriter, merge_rank_manifests
from .store.resume import deal_for
from .summary import ExtractSummary, check_finite, sha256_text

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


def settings_for(cfg: ExtractConfig, loaded, points: list[str]) -> dict:
    """Everything that shapes the stored rows: a store made with other settings is refused. The
    number of processes does not shape them: a store started by N processes is finished by M."""
    return {
        "model": loaded.name,
        "revision": cfg.revision,
        "model_class": type(loaded.model).__name__,
        "config_sha256": sha256_text(loaded.model.config.to_json_string(use_diff=False)),
        "tokenizer_sha256": tokenizer_hash(loaded.tokenizer),
        "points": points,
        "dtype": cfg.dtype,
        "context": cfg.context,
        "batch_size": cfg.batch_size,
        "drop_bos": cfg.drop_bos,
        "packing": pack_policy(loaded.tokenizer).as_dict(),
        "data": cfg.data,
        "data_fingerprint": source_fingerprint(cfg.data, text_field=cfg.text_field),  # contents, hashed
        # the builtin corpus is this Python's own docstrings: another version, another corpus
        "python": list(sys.version_info[:2]) if cfg.data.startswith("builtin:") else None,
        "text_field": cfg.text_field,
        **({"generate": cfg.generate} if cfg.generate else {}),  # absent: stores made before keep their hash
    }


def _dist_info() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _init_distributed(world_size: int, device: str) -> None:
    import torch.distributed as dist

    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")


class ExtractInterrupted(KeyboardInterrupt):
    """SIGINT / SIGTERM stopped an extraction cleanly: whole shards are committed, nothing else is
    kept, and the same command resumes to a store byte-identical to an uninterrupted run's."""

    def __init__(self, rows: int, out: str):
        super().__init__(rows, out)
        self.rows, self.out = rows, out

    def __str__(self) -> str:
        return f"interrupted after {self.rows:,} rows; run the same command to resume"


def validate_config(cfg: ExtractConfig) -> None:
    """Refuse bad arguments before anything is loaded or written."""
    if cfg.on_nonfinite not in ("warn", "error"):
        raise HookscopeError(f"on_nonfinite={cfg.on_nonfinite!r}: use 'warn' or 'error'")
    dtype = getattr(torch, cfg.dtype, None) if isinstance(cfg.dtype, str) else None
    if cfg.dtype not in ("float32", "float16", "bfloat16") or not isinstance(dtype, torch.dtype):
        raise HookscopeError(f"unknown dtype {cfg.dtype!r}: use float32, float16 or bfloat16")
    for name in ("batch_size", "context", "shard_rows"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            flag = "--" + name.replace("_", "-")
            raise HookscopeError(f"{flag} {value!r}: must be a whole number >= 1")
    if cfg.max_tokens is not None and (isinstance(cfg.max_tokens, bool) or not isinstance(cfg.max_tokens, int)
                                       or cfg.max_tokens < 1):
        raise HookscopeError(f"--max-tokens {cfg.max_tokens!r}: must be a whole number >= 1 (or left out)")
    if not cfg.points:
        raise HookscopeError("no points given; name at least one, e.g. --points blocks.3.resid_post")
    if not str(cfg.out).strip():
        raise HookscopeError("--out is empty; name the store directory to write")


def extract(cfg: ExtractConfig) -> ExtractSummary:
    """Run the pipeline described by `cfg`; see the module docstring.

    Everything that can be checked is checked before the store is touched (arguments, the model,
    the points, the data source's first batch and its forward pass), so a refused run leaves no
    trace on disk. SIGINT / SIGTERM raise `ExtractInterrupted` after committing whole shards only."""
    validate_config(cfg)
    if is_image_source(cfg.data):  # a folder of images, for a vision encoder
        return extract_images(cfg)
    opened: list[ShardWriter] = []  # the writer, once the store is open: how many rows it holds
    with _signals_interrupt():
        try:
            return _extract(cfg, opened)
        except KeyboardInterrupt:
            raise ExtractInterrupted(opened[0].total_rows if opened else 0, str(cfg.out)) from None


def _extract(cfg: ExtractConfig, opened: list[ShardWriter]) -> ExtractSummary:
    rank, world_size = _dist_info()
    _init_distributed(world_size, cfg.device)
    device = (f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cfg.device == "cuda" and world_size > 1
              else cfg.device)
    loaded = load(cfg.model, device=device, revision=cfg.revision, device_map=cfg.device_map)
    if cfg.device_map is not None:  # inputs go where the embeddings live
        device = str(loaded.model.get_input_embeddings().weight.device)
    dtype = getattr(torch, cfg.dtype)
    points = [s.name for s in loaded.arch.resolve(cfg.points)]  # unknown names fail before any work
    longest = max_positions(loaded.model)
    if longest is not None and cfg.context > longest:
        raise HookscopeError(f"context {cfg.context} is longer than the model's {longest} positions; use "
                             f"--context {longest} or less")
    if cfg.generate and longest is not None and cfg.context + cfg.generate > longest:
        raise HookscopeError(f"--context {cfg.context} + --generate {cfg.generate} is longer than the "
                             f"model's {longest} positions; lower one of them")

    settings = settings_for(cfg, loaded, points)
    # which batches this rank goes through: read from the store's manifests, nothing written yet
    deal = deal_for(cfg.out, settings, world_size)
    documents = ReadMeter(iter_documents(cfg.data, text_field=cfg.text_field), source_chars(cfg.data))
    sequences = pack(documents, loaded.tokenizer, context=cfg.context, max_tokens=cfg.max_tokens)
    started = time.perf_counter()
    done = skipped = new_rows = 0

    def compute(index: int, batch: dict[str, torch.Tensor]) -> tuple[dict, dict, int]:
        keep = _keep_mask(cfg, batch)
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
        check_finite(acts, cfg.on_nonfinite, index)
        return acts, meta, len(meta["token_ids"])

    # The first batch of this rank is read and run before the store is opened: an empty or bad
    # data source, or a point the forward pass never reaches, is refused with nothing written.
    # On a resume it may be a batch already on disk; one forward pass is the price of that check.
    ours = ((i, b) for i, b in enumerate(batches(sequences, cfg.batch_size)) if deal.visits(i, rank))
    first = next(ours, None)
    if first is None and rank == 0:
        raise DataError(f"data source {cfg.data!r} gives no tokens to extract; point --data at some text")
    checked = (first[0], compute(*first)) if first is not None else None

    progress = _Progress(cfg.progress and rank == 0, cfg, documents, world_size)
    try:
        writer = ShardWriter(cfg.out, settings, shard_rows=cfg.shard_rows, rank=rank, world_size=world_size)
        opened.append(writer)
        with writer:  # on an interrupt it commits whole shards only (see ShardWriter.__exit__)
            if writer.deal != deal:  # the store changed since it was read above
                raise StoreError(f"{cfg.out} changed while this run started: is another run writing to "
                                 "it? Stop every other run on this store and re-run the command")
            for index, batch in itertools.chain([first] if first else [], ours):
                if index in writer.done_batches:
                    skipped += 1
                    progress.update(_kept(cfg, batch), batch, writer.bytes_written)
                    continue
                if checked is not None and checked[0] == index:
                    (acts, meta, rows), checked = checked[1], None
                else:
                    acts, meta, rows = compute(index, batch)
                writer.write(index, acts, meta)
                done += 1
                new_rows += rows
                progress.update(rows, batch, writer.bytes_written)
    finally:
        # the last shard is on disk now: the bar ends on the summary's MiB
        progress.close(opened[0].bytes_written if opened else 0)
    total_rows = writer.total_rows
    nonfinite = dict(writer.nonfinite)
    bytes_written = writer.bytes_written
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()
        if rank == 0:
            merge_rank_manifests(cfg.out, world_size)
        dist.barrier()
    return ExtractSummary(cfg.out, total_rows, new_rows, done, skipped, time.perf_counter() - started,
                          bytes_written, nonfinite)


@contextlib.contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM (a scheduler's preemption, torchrun stopping its workers) stops the run as Ctrl-C
    does. Only the main thread may set signal handlers; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _keep_mask(cfg: ExtractConfig, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tokens of a batch that become rows: real tokens, less BOS / CLS / SEP unless kept."""
    keep = batch["attention_mask"].bool()
    if cfg.drop_bos:
        keep &= ~batch["special_mask"].bool()
    return keep


def _kept(cfg: ExtractConfig, batch: dict[str, torch.Tensor]) -> int:
    return int(_keep_mask(cfg, batch).sum())


class _Progress:
    """tqdm bar in rows, the summary's unit: percent and ETA against a total estimated from
    --max-tokens and from how much of the data source has been read, and the MiB written. Made at
    the first batch, so that an error found before any work prints no empty bar."""

    def __init__(self, enabled: bool, cfg: ExtractConfig, meter: ReadMeter, world_size: int):
        self.enabled, self.meter, self.bar = enabled, meter, None
        # the tokens this rank will run within --max-tokens (whole sequences only)
        self.budget = (None if cfg.max_tokens is None
                       else cfg.max_tokens // cfg.context * cfg.context / world_size)
        self.rows = self.tokens = 0
        self.last_doc = -1

    def update(self, rows: int, batch: dict[str, torch.Tensor], bytes_written: int) -> None:
        if not self.enabled:
            return
        tokens = int(batch["attention_mask"].sum())
        self.last_doc = max(self.last_doc, int(batch["doc_ids"].max()))  # packed up to this document
        if self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(unit="row", unit_scale=True, desc="extract", dynamic_ncols=True)
        self.rows, self.tokens = self.rows + rows, self.tokens + tokens
        estimate = self._estimated_rows()
        if estimate is not None:
            self.bar.total = max(estimate, self.rows)
        self.bar.set_postfix_str(f"{bytes_written / 2**20:,.1f} MiB written", refresh=False)
        self.bar.update(rows)

    def _estimated_rows(self) -> int | None:
        estimates = []
        if self.budget is not None and self.tokens:
            estimates.append(self.rows * self.budget / self.tokens)  # rows per token so far
        fraction = self.meter.fraction(self.last_doc if self.last_doc >= 0 else None)
        if fraction:
            estimates.append(self.rows / fraction)
        return int(min(estimates)) if estimates else None

    def close(self, bytes_written: int) -> None:
        if self.bar is not None:
            self.bar.total = self.bar.n  # the estimate is done with: the bar ends at 100%
            self.bar.set_postfix_str(f"{bytes_written / 2**20:,.1f} MiB written", refresh=False)
            self.bar.refresh()
            self.bar.close()
