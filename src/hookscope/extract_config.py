"""What an extraction is asked to do (`ExtractConfig`, one field per `hookscope extract` option),
the checks of it that need nothing loaded, and where this process runs it (`Run`). Below both
`sources/` (a source is opened with them) and `extract/` (the loop builds them), so neither room
reaches into the other for its options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import HookscopeError
from .names import is_pattern

DEFAULT_DATA = "builtin:stdlib-docstrings"
DEFAULT_POINT = "blocks.3.resid_post"


@dataclass
class ExtractConfig:
    """What `hs.extract` runs: the options of `hookscope extract`, one field per flag.

    `out` (the store: a directory or a URL), `model` (hub id or directory; None: the bundled
    MiniLM), `points`, `data` (a .txt / .jsonl file or folder, a saved dataset, `hf:NAME`,
    `images:DIR`; default: Python's own docstrings, built offline), `context` tokens per sequence,
    `batch_size`, `dtype` of the stored rows, `max_tokens`, `shard_rows` per shard, `max_memory`
    to stream blocks under a weight budget, `workers` processes that tokenize text, `stack` (each
    glob of `points` stored as one `[rows, blocks, ...]` column), `tp` ranks per tensor-parallel
    copy of the model under torchrun (TP x DP). Checked by `hs.extract` before anything is loaded."""

    out: str
    model: str | None = None
    points: list[str] = field(default_factory=lambda: [DEFAULT_POINT])
    data: str = DEFAULT_DATA
    text_field: str = "text"
    context: int | None = None  # tokens per packed sequence (text: 128 when left out; images: none)
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
    generate: int = 0  # --generate N: also store N greedy tokens after each sequence (sources/generated.py)
    # --max-memory SIZE ("2GiB"): stream the blocks through chunks of batches, weights under SIZE
    # (loading/streamer.py). Not a setting of the store: the rows are the same with it or without it
    max_memory: str | int | None = None
    # --workers N: processes that tokenize text (0: the data thread, with the tokenizer's own threads).
    # Not a setting of the store: the batches are the same for any N
    workers: int = 0
    # --stack: each glob of `points` stored as one column named by the glob, [rows, blocks, *row
    # shape], its blocks in order (extract/stacking.py): a crosscoder's or CLT's read gathers each
    # row's layers in one piece
    stack: bool = False
    # --tp N: under torchrun, each N consecutive ranks hold one tensor-parallel copy of the model
    # (hs.load(tp=N)) and run the same batches; its first rank writes them. Not a setting of the
    # store: a resume may use another N (the rows differ only by the all-reduce's float rounding)
    tp: int = 1
    # --engine vllm: the forward runs in a vLLM engine made for the run from `model` (a local
    # Hugging Face directory), or in the `vllm.LLM` given here (extract/served.py); None: Hugging
    # Face in this process. Not a setting of the store: the rows are the same to float tolerance
    engine: Any = None
    # --engine-arg KEY=VALUE: keyword arguments of the vLLM engine made for the run
    engine_args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Run:
    """Where this process runs: its data-parallel rank and how many there are (the torchrun rank
    and world size; under `tp`, its tensor-parallel group's and the number of groups: the batches
    are dealt among groups), the device inputs go to, and whether it writes its rows (one rank per
    group does; the others compute with it, for the collectives of the sharded forward)."""

    rank: int
    world_size: int
    device: str
    writes: bool = True

    @classmethod
    def of_process(cls, rank: int, world_size: int, device: str, tp: int = 1) -> Run:
        """The Run of torchrun's `rank` of `world_size` under `tp`: the groups are consecutive
        ranks, as `hs.load(tp=)` lays them out (loading/loader.py)."""
        return cls(rank // tp, world_size // tp, device, writes=rank % tp == 0)


def _whole(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def validate_config(cfg: ExtractConfig) -> None:
    """Refuse bad arguments before anything is loaded or written."""
    _check_numbers(cfg)
    _check_points_and_out(cfg)
    _check_engine_options(cfg)


def _check_numbers(cfg: ExtractConfig) -> None:
    """The dtype, the non-finite policy and the sizes and counts."""
    if cfg.on_nonfinite not in ("warn", "error"):
        raise HookscopeError(f"on_nonfinite={cfg.on_nonfinite!r}: use 'warn' or 'error'")
    dtype = getattr(torch, cfg.dtype, None) if isinstance(cfg.dtype, str) else None
    if cfg.dtype not in ("float32", "float16", "bfloat16") or not isinstance(dtype, torch.dtype):
        raise HookscopeError(f"unknown dtype {cfg.dtype!r}: use float32, float16 or bfloat16")
    for name in ("batch_size", "context", "shard_rows", "tp"):
        value = getattr(cfg, name)
        if not (_whole(value) or (name == "context" and value is None)):
            flag = "--" + name.replace("_", "-")
            raise HookscopeError(f"{flag} {value!r}: must be a whole number >= 1")
    if isinstance(cfg.workers, bool) or not isinstance(cfg.workers, int) or cfg.workers < 0:
        raise HookscopeError(
            f"--workers {cfg.workers!r}: must be a whole number >= 0 "
            "(0 tokenizes in the extraction's own data thread)"
        )
    if cfg.max_tokens is not None and not _whole(cfg.max_tokens):
        raise HookscopeError(f"--max-tokens {cfg.max_tokens!r}: must be a whole number >= 1 (or left out)")


def _check_points_and_out(cfg: ExtractConfig) -> None:
    """What is captured, where it goes, and how the model runs."""
    if not cfg.points:
        raise HookscopeError("no points given; name at least one, e.g. --points blocks.3.resid_post")
    if cfg.stack and not any(is_pattern(p) for p in cfg.points):
        raise HookscopeError(
            f"--stack stores each glob of --points as one column, and {cfg.points} has no "
            "glob: name one, e.g. --points 'blocks.*.resid_post', or leave --stack out"
        )
    if not str(cfg.out).strip():
        raise HookscopeError("--out is empty; name the store directory to write")
    if cfg.max_memory is not None:
        from .loading import parse_size

        parse_size(cfg.max_memory)
        for flag, value in (
            ("--generate", cfg.generate),
            ("--device-map", cfg.device_map),
            ("--tp", cfg.tp > 1),
        ):
            if value:
                raise HookscopeError(
                    f"--max-memory streams blocks through one device; it does not combine "
                    f"with {flag}: leave one of them out"
                )


def _check_engine_options(cfg: ExtractConfig) -> None:
    """The options that place or run the model in this process, which a served engine does itself."""
    if cfg.engine is None:
        if cfg.engine_args:
            raise HookscopeError("--engine-arg sets an engine's options: add --engine vllm, or leave it out")
        return
    placing = (
        ("--max-memory", cfg.max_memory),
        ("--device-map", cfg.device_map),
        ("--generate", cfg.generate),
        ("--device", cfg.device if cfg.device != "cpu" else None),
        ("--tp", cfg.tp if cfg.tp != 1 else None),
    )
    for flag, value in placing:
        if value:
            raise HookscopeError(
                f"{flag} {value}: with --engine vllm the engine places and runs the model itself; "
                f"leave {flag} out (engine options go in --engine-arg KEY=VALUE)"
            )
