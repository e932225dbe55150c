"""Images for vision encoders: a folder of image files -> the model's own image processor -> pixel
batches; one row per token (CLS and patches) of each image.

    hookscope extract MODEL_DIR --data images:photos/ --points blocks.1.resid_post --out acts/

Every row traces back to its image and patch (columns.patch_columns): `doc_ids` is the image's
index in the manifest's `settings["images"]` (paths relative to the folder, sorted), `positions`
the token position, `patch_rows` / `patch_cols` the patch's place in the grid (-1 for CLS /
register tokens, which sit before the patches). Rows follow the model's token order, every
token kept. `--max-tokens N` keeps the first N // T images, T being the tokens of one image
(whole images only, as text keeps whole sequences); `--context` and `--generate` have no meaning
here and are refused, as is `--keep-bos` (nothing is dropped to keep).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..errors import DataError, HookscopeError
from ..extract_config import ExtractConfig, Run
from ..loading import Loaded, sha256_text
from ..stopping import Stop
from .base import Rows, Source
from .columns import patch_columns
from .identity import model_identity, point_meanings

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
    folder = Path(data[len(PREFIX) :] if data.startswith(PREFIX) else data).expanduser()
    if not folder.is_dir():
        raise DataError(f"--data {data}: no folder {folder}; give images:DIR with image files in it")
    names = sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES
    )
    if not names:
        raise DataError(f"--data {data}: no image files ({', '.join(SUFFIXES)}) under {folder}")
    return folder, names


def load_processor(model_dir: str) -> Any:
    """The image processor saved beside the model (save_pretrained), never one from the hub."""
    from transformers import AutoImageProcessor

    try:
        try:
            return AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
        except ImportError:
            # transformers 5.17's Auto class demands torchvision where the processor's own class falls
            # back to its Pillow twin (later releases fall back themselves): load that class by name
            return _named_processor(model_dir)
    except (OSError, ValueError) as exc:
        raise HookscopeError(
            f"{model_dir!r} has no usable image processor ({exc}); save the model's processor beside it "
            "with processor.save_pretrained(MODEL_DIR)"
        ) from exc


def _named_processor(model_dir: str) -> Any:
    import transformers

    config = json.loads((Path(model_dir).expanduser() / "preprocessor_config.json").read_text())
    cls = getattr(transformers, str(config.get("image_processor_type")), None)
    if cls is None:
        raise HookscopeError(
            f"{model_dir!r}: its image processor {config.get('image_processor_type')!r} "
            f"needs torchvision or a newer transformers ({transformers.__version__})"
        )
    return cls.from_pretrained(model_dir, local_files_only=True)


def has_image_processor(model_dir: str | None) -> bool:
    """Whether a local model directory carries an image processor (a vision encoder)."""
    return model_dir is not None and (Path(model_dir).expanduser() / "preprocessor_config.json").is_file()


def sample_input(model_dir: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    """One mid-grey picture through the model's own processor (for `hookscope points` shapes)."""
    from PIL import Image

    picture = Image.new("RGB", (64, 64), (128, 128, 128))
    pixels = load_processor(model_dir)(images=[picture], return_tensors="pt")["pixel_values"]
    return {"pixel_values": pixels.to(device)}


def patch_grid(model: torch.nn.Module, pixels: torch.Tensor) -> tuple[int, int]:
    """Rows and columns of patches the model cuts an input of this size into."""
    config = getattr(model, "config", None)
    config = getattr(config, "vision_config", None) or config
    patch = getattr(config, "patch_size", None)
    if patch is None:
        raise HookscopeError(
            f"{type(model).__name__}: no patch_size in its config; not a patch-based encoder"
        )
    ph, pw = (patch, patch) if isinstance(patch, int) else patch
    return pixels.shape[-2] // ph, pixels.shape[-1] // pw


def _first_block_tokens(model: torch.nn.Module, first_block: str, pixels: Tensor, device: str) -> int:
    """The token length of the first block's input for these pixels, in a pass stopped there. On a
    model still on `meta` (a block-streamed run, before any weight is read) the pass runs on meta:
    shapes only."""
    if next(model.parameters()).is_meta:
        device = "meta"
    lengths: list[int] = []

    def count(args: tuple, kwargs: dict) -> None:
        hidden = next(x for x in (*args, *kwargs.values()) if isinstance(x, Tensor))
        lengths.append(hidden.shape[1])  # [picture, token, d_model]

    stop = Stop()  # the pass ends at the first block's input
    # first in line: before a points= load's guard on a block that was not loaded
    handle = stop.before(model.get_submodule(first_block), count, first=True)
    try:
        with torch.inference_mode():
            stop.run(model, {"pixel_values": pixels.to(device)})
    finally:
        handle.remove()
    return lengths[0]


def _fingerprint(folder: Path, names: list[str]) -> str:
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode() + b"\0")
        digest.update(hashlib.sha256((folder / name).read_bytes()).digest())
    return digest.hexdigest()


class ImageSource(Source):
    needs_tokenizer = False

    @classmethod
    def claims(cls, cfg: ExtractConfig) -> bool:
        return is_image_source(cfg.data)

    @classmethod
    def check_config(cls, cfg: ExtractConfig) -> None:
        if cfg.context is not None:
            raise HookscopeError(
                f"--context {cfg.context}: an image's tokens are set by the model's image "
                "processor and patch size; leave --context out for images"
            )
        if cfg.generate:
            raise HookscopeError(
                f"--generate {cfg.generate}: images have no continuation to generate; leave "
                "--generate out for images"
            )
        if not cfg.drop_bos:  # nothing to keep: no image row is ever dropped
            raise HookscopeError(
                "--keep-bos: images always keep every token, CLS and register tokens "
                "included (their patch_rows / patch_cols are -1: select patch_rows >= 0 "
                "for the patches alone); leave --keep-bos out for images"
            )

    @classmethod
    def open(cls, cfg: ExtractConfig, loaded: Loaded, points: list[str], run: Run) -> ImageSource:
        folder, names = list_images(cfg.data)
        return cls(cfg, loaded, points, run, folder, names)

    def __init__(
        self, cfg: ExtractConfig, loaded: Loaded, points: list[str], run: Run, folder: Path, names: list[str]
    ):
        self.cfg, self.loaded, self.points, self.run = cfg, loaded, points, run
        self.folder, self.names = folder, names
        self.processor = load_processor(loaded.name)
        self.tokens_per_image: int | None = None  # known once an image has run
        self.picture_tokens: int | None = None  # the same, from a pass stopped before the blocks
        self.images = len(names)  # how many are extracted: all, or as many as --max-tokens holds
        if cfg.max_tokens is not None:
            tokens = self._tokens_per_image()
            self.images = min(len(names), cfg.max_tokens // tokens)
            if not self.images:
                raise DataError(
                    f"--max-tokens {cfg.max_tokens} holds no whole image: each of "
                    f"{self.loaded.name} gives {tokens} tokens; give at least {tokens}"
                )

    def settings(self) -> dict[str, Any]:
        """Everything that shapes the stored rows. A resume compares these with the store's key for
        key, so a key renamed or added here would refuse every image store already written."""
        return {
            **model_identity(self.loaded),
            "image_processor_sha256": sha256_text(self.processor.to_json_string()),
            "points": self.points,
            "dtype": self.cfg.dtype,
            "batch_size": self.cfg.batch_size,
            "data": self.cfg.data,
            "images": self.names,
            "images_sha256": _fingerprint(self.folder, self.names),
            **point_meanings(self.loaded, self.points),  # DINOv2's attn.out / mlp.out: after LayerScale
        }

    def batches(self) -> Iterator[dict[str, Tensor]]:
        """{"images": the images' indices, "pixel_values"} per batch, in file order."""
        for start in range(0, self.images, self.cfg.batch_size):
            index = list(range(start, min(start + self.cfg.batch_size, self.images)))
            yield {"images": torch.tensor(index), "pixel_values": self._pixels(index)}

    def _pixels(self, index: list[int]) -> Tensor:
        from PIL import Image

        pictures = []
        for i in index:
            try:
                with Image.open(self.folder / self.names[i]) as im:
                    pictures.append(im.convert("RGB"))
            except OSError as exc:
                raise DataError(f"cannot read image {self.folder / self.names[i]}: {exc}") from exc
        return self.processor(images=pictures, return_tensors="pt")["pixel_values"]

    def _tokens_per_image(self) -> int:
        """How many tokens a picture becomes (patches + CLS + registers: whatever the family adds),
        read from the first block's input in a pass over one image stopped there (nothing written)."""
        if self.picture_tokens is None:
            self.picture_tokens = _first_block_tokens(
                self.loaded.model, self.loaded.arch.block_paths[0], self._pixels([0]), self.run.device
            )
        return self.picture_tokens

    def item_tokens(self) -> int:
        return self._tokens_per_image()

    def _tokens(self, acts: dict[str, Tensor]) -> int:
        lengths = {a.shape[1] for a in acts.values() if a.dim() >= 3}
        if len(lengths) != 1 or any(a.dim() < 3 for a in acts.values()):
            raise HookscopeError(
                f"points {self.points} are not all [image, token, ...] of one length; extract per-token "
                "points (resid_*, attn.*, mlp.*) together"
            )
        self.tokens_per_image = lengths.pop()
        return self.tokens_per_image

    def model_call(self, batch: dict[str, Tensor]) -> tuple[dict[str, Tensor], Tensor | None]:
        return {"pixel_values": batch["pixel_values"]}, None

    def rows(self, batch: dict[str, Tensor], acts: dict[str, Tensor]) -> Rows:
        n_tokens = self._tokens(acts)
        columns = patch_columns(
            batch["images"].tolist(), n_tokens, patch_grid(self.loaded.model, batch["pixel_values"])
        )
        return {name: a.flatten(0, 1) for name, a in acts.items()}, columns  # [image * token, ...]

    def rows_in(self, batch: dict[str, Tensor]) -> int | None:
        # the loop runs a batch before it skips any (its check before the store opens)
        return None if self.tokens_per_image is None else len(batch["images"]) * self.tokens_per_image

    def estimate(self, rows: int, batch: dict[str, Tensor]) -> int | None:
        done = int(batch["images"].max()) + 1  # images are in order: this batch's last one
        return rows * self.images // done

    def nothing_to_extract(self) -> str:
        return f"--data {self.cfg.data}: no image to extract"
