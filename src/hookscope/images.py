"""Images as a data source for vision encoders: a folder of image files -> the model's own image
processor -> pixel batches -> capture -> store, one row per token (CLS and patches) of each image.

    hookscope extract MODEL_DIR --data images:photos/ --points blocks.1.resid_post --out acts/

Every row traces back to its image and patch: `doc_ids` is the image's index in the manifest's
`settings["images"]` (paths relative to the folder, sorted), `positions` the token position,
`patch_rows` / `patch_cols` the patch's place in the grid (-1 for CLS / register tokens, which sit
before the patches). Rows follow the model's token order: prefix tokens, then patches row-major.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .capture import Capture
from .errors import DataError, HookscopeError
from .models import load
from .store import ShardWriter
from .summary import ExtractSummary, check_finite, sha256_text

PREFIX = "images:"
SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def is_image_source(data: str) -> bool:
    """`images:DIR`, or a directory that holds image files and nothing that reads as text."""
    if data.startswith(PREFIX):
        return True
    path = Path(data)
    if not path.is_dir():
        return False
    files = [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    return bool(files) and all(p.suffix.lower() in SUFFIXES for p in files)


def list_images(data: str) -> tuple[Path, list[str]]:
    """The folder and its image files (relative paths, sorted: the order is the image index)."""
    folder = Path(data[len(PREFIX):] if data.startswith(PREFIX) else data).expanduser()
    if not folder.is_dir():
        raise DataError(f"--data {data}: no folder {folder}; give images:DIR with image files in it")
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                   if p.is_file() and p.suffix.lower() in SUFFIXES)
    if not names:
        raise DataError(f"--data {data}: no image files ({', '.join(SUFFIXES)}) under {folder}")
    return folder, names


def load_processor(model_dir: str) -> Any:
    """The image processor saved beside the model (save_pretrained), never one from the hub."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise HookscopeError(
            f"{model_dir!r} has no usable image processor ({exc}); save the model's processor beside it "
            "with processor.save_pretrained(MODEL_DIR)") from exc


def has_image_processor(model_dir: str | None) -> bool:
    """Whether a local model directory carries an image processor (a vision encoder)."""
    return model_dir is not None and (Path(model_dir).expanduser() / "preprocessor_config.json").is_file()


def sample_input(model_dir: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    """One mid-grey picture through the model's own processor (for `hookscope points` shapes)."""
    from PIL import Image

    picture = Image.new("RGB", (64, 64), (128, 128, 128))
    pixels = load_processor(model_dir)(images=[picture], return_tensors="pt")["pixel_values"]
    return {"pixel_values": pixels.to(device)}


def image_batches(folder: Path, names: list[str], processor: Any, batch_size: int
                  ) -> Iterator[tuple[list[int], torch.Tensor]]:
    """(image indices, pixel_values) per batch, in file order."""
    from PIL import Image

    for start in range(0, len(names), batch_size):
        index = list(range(start, min(start + batch_size, len(names))))
        pictures = []
        for i in index:
            try:
                with Image.open(folder / names[i]) as im:
                    pictures.append(im.convert("RGB"))
            except OSError as exc:
                raise DataError(f"cannot read image {folder / names[i]}: {exc}") from exc
        pixels = processor(images=pictures, return_tensors="pt")["pixel_values"]
        yield index, pixels


def patch_grid(model: torch.nn.Module, pixels: torch.Tensor) -> tuple[int, int]:
    """Rows and columns of patches the model cuts an input of this size into."""
    config = getattr(model, "config", None)
    config = getattr(config, "vision_config", None) or config
    patch = getattr(config, "patch_size", None)
    if patch is None:
        raise HookscopeError(
            f"{type(model).__name__}: no patch_size in its config; not a patch-based encoder")
    ph, pw = (patch, patch) if isinstance(patch, int) else patch
    return pixels.shape[-2] // ph, pixels.shape[-1] // pw


def trace_rows(n_tokens: int, grid: tuple[int, int]) -> dict[str, torch.Tensor]:
    """positions / patch_rows / patch_cols of one image's tokens (prefix tokens come first)."""
    rows, cols = grid
    prefix = n_tokens - rows * cols
    if prefix < 0:
        raise HookscopeError(f"{n_tokens} tokens but a {rows}x{cols} patch grid: the point is not per patch")
    patch = torch.arange(n_tokens) - prefix
    return {"positions": torch.arange(n_tokens),
            "patch_rows": torch.where(patch >= 0, patch // cols, -1),
            "patch_cols": torch.where(patch >= 0, patch % cols, -1)}


def _fingerprint(folder: Path, names: list[str]) -> str:
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode() + b"\0")
        digest.update(hashlib.sha256((folder / name).read_bytes()).digest())
    return digest.hexdigest()


def extract_images(cfg: Any) -> Any:
    """`extract` for an image folder (cfg: an `ExtractConfig`); returns an `ExtractSummary`."""
    from tqdm.auto import tqdm

    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        raise HookscopeError("image extraction runs in one process; run it without torchrun")
    folder, names = list_images(cfg.data)
    loaded = load(cfg.model, device=cfg.device, revision=cfg.revision, tokenizer=False, points=cfg.points)
    processor = load_processor(loaded.name)
    dtype = getattr(torch, cfg.dtype)  # extract.validate_config has checked it
    points = [s.name for s in loaded.arch.resolve(cfg.points)]
    settings = {
        "model": loaded.name,
        "model_class": type(loaded.model).__name__,
        "config_sha256": sha256_text(loaded.model.config.to_json_string(use_diff=False)),
        "image_processor_sha256": sha256_text(processor.to_json_string()),
        "points": points,
        "dtype": cfg.dtype,
        "batch_size": cfg.batch_size,
        "data": cfg.data,
        "images": names,
        "images_sha256": _fingerprint(folder, names),
    }
    started, done, skipped, new_rows = time.perf_counter(), 0, 0, 0
    progress = tqdm(total=len(names), unit="image", desc="extract", disable=not cfg.progress,
                    dynamic_ncols=True)
    with ShardWriter(cfg.out, settings, shard_rows=cfg.shard_rows) as writer:
        for batch, (index, pixels) in enumerate(image_batches(folder, names, processor, cfg.batch_size)):
            if batch in writer.done_batches:
                skipped += 1
                progress.update(len(index))
                continue
            with Capture(loaded.model, points, dtype=dtype, device="cpu") as cap:
                cap.run({"pixel_values": pixels.to(cfg.device)})
                acts = {name: cap[name] for name in points}
            lengths = {a.shape[1] for a in acts.values() if a.dim() >= 3}
            if len(lengths) != 1 or any(a.dim() < 3 for a in acts.values()):
                raise HookscopeError(
                    f"points {points} are not all [image, token, ...] of one length; extract per-token "
                    "points (resid_*, attn.*, mlp.*) together")
            n_tokens = lengths.pop()
            trace = trace_rows(n_tokens, patch_grid(loaded.model, pixels))
            acts = {name: a.flatten(0, 1) for name, a in acts.items()}  # [image * token, ...]
            meta = {"doc_ids": torch.tensor(index).repeat_interleave(n_tokens),
                    **{k: v.repeat(len(index)) for k, v in trace.items()}}
            check_finite(acts, cfg.on_nonfinite, batch)
            writer.write(batch, acts, meta)
            done += 1
            new_rows += len(index) * n_tokens
            progress.update(len(index))
        writer.close()
        total, nonfinite, written = writer.total_rows, dict(writer.nonfinite), writer.bytes_written
    progress.close()
    return ExtractSummary(cfg.out, total, new_rows, done, skipped, time.perf_counter() - started, written,
                          nonfinite)
