"""What several commands share: the model and points arguments, the argument types, loading a
model quietly and encoding a sentence."""

from __future__ import annotations

import argparse
import os

DEFAULT_TEXT = "Interpretability starts with looking at the activations."
DTYPES = ["float32", "float16", "bfloat16"]


def quiet_transformers() -> None:
    # transformers prints load-progress bars and advisory warnings that drown our output
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging

        logging.set_verbosity_error()
        logging.disable_progress_bar()
    except ImportError:
        pass


def load(args, points: list[str] | None = None):
    """The command's model; with `points`, only the weights they need (`hs.load(points=...)`)."""
    import hookscope as hs

    quiet_transformers()
    return hs.load(args.model, device=args.device, points=points)


def encode(loaded, text: str):
    from ..errors import HookscopeError

    if loaded.tokenizer is None:
        raise HookscopeError("this model has no tokenizer; give token ids from Python instead")
    inputs = dict(loaded.tokenizer([text], return_tensors="pt"))
    if inputs["input_ids"].shape[-1] == 0:
        raise HookscopeError(f"--text {text!r} gives no tokens; give some text")
    return inputs


def device(value: str) -> str:
    """A device this machine has: cpu, cuda, cuda:N or mps."""
    import torch

    try:
        parsed = torch.device(value)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a device: use cpu, cuda or cuda:N") from None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if parsed.type == "cuda" and (parsed.index or 0) >= gpus:
        raise argparse.ArgumentTypeError(f"{value}: this machine has {gpus} CUDA device(s); use --device cpu")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError("mps is not available on this machine; use --device cpu")
    if parsed.type not in ("cpu", "cuda", "mps"):
        raise argparse.ArgumentTypeError(f"{value!r}: use cpu, cuda, cuda:N or mps")
    return value


def at_least(minimum: int):
    def parse(value: str) -> int:
        number = int(value)  # a ValueError becomes argparse's "invalid value" message
        if number < minimum:
            raise argparse.ArgumentTypeError(f"{number} is less than {minimum}")
        return number

    parse.__name__ = f"int >= {minimum}"  # how argparse names the type in its messages
    return parse


def positions(value: str | None):
    """all | last | N | A:B | i,j,k"""
    if value is None or value == "all":
        return None
    if value == "last":
        return "last"
    try:
        if ":" in value:
            start, _, stop = value.partition(":")
            return slice(int(start) if start else None, int(stop) if stop else None)
        return [int(v) for v in value.split(",")] if "," in value else int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a position selection: use all, last, N, A:B or i,j,k (negative N counts "
            "from the end)"
        ) from None


def point_list(value: str) -> list[str]:
    names = [x.strip() for x in value.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{value!r} names no point; e.g. blocks.3.resid_post")
    return names


def model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="Hugging Face id or local directory (default: the bundled all-MiniLM-L6-v2)",
    )
    p.add_argument("--device", default="cpu", type=device, help="cpu, cuda, cuda:N or mps")


def points_arg(p: argparse.ArgumentParser, *, help: str, required: bool = False, default=None) -> None:
    # --points is the documented spelling; --point is accepted too (one point is a list of one)
    group = p.add_mutually_exclusive_group(required=required)
    group.add_argument("--points", type=point_list, default=default, help=help)
    group.add_argument("--point", dest="points", type=point_list, help=argparse.SUPPRESS)
