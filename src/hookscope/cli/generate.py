"""`hookscope generate MODEL --prompt TEXT`: generate text, capturing / steering points on the way."""

from __future__ import annotations

import argparse
import sys

from .args import DTYPES, at_least, load, model_args, positions


def _steer_arg(value: str):
    """POINT:VECTOR_FILE:SCALE (split from the right: a point name may hold colons)."""
    parts = value.rsplit(":", 2)
    if len(parts) != 3 or not parts[0] or not parts[1]:
        raise argparse.ArgumentTypeError(
            f"--steer {value!r}: use POINT:VECTOR_FILE:SCALE, e.g. blocks.3.resid_post:vec.safetensors:4"
        )
    try:
        scale = float(parts[2])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--steer {value!r}: the scale {parts[2]!r} is not a number"
        ) from None
    return parts[0], parts[1], scale


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text, capturing and steering points at every token")
    model_args(p)
    p.add_argument(
        "--prompt",
        action="append",
        required=True,
        help="prompt text (repeat for a batch; prompts are left-padded)",
    )
    p.add_argument("--max-new-tokens", type=at_least(1), default=20)
    p.add_argument("--points", default=None, help="point name(s) to capture, comma-separated or a glob")
    p.add_argument(
        "--positions",
        type=positions,
        default=None,
        help="sequence positions to keep: all | last | N | A:B | i,j,k",
    )
    p.add_argument("--dtype", default=None, choices=DTYPES)
    p.add_argument("--out", default=None, help="write captures (+ sequences, mask) to this .safetensors file")
    p.add_argument(
        "--steer",
        type=_steer_arg,
        action="append",
        default=[],
        help="POINT:VECTOR_FILE:SCALE, add SCALE x the vector (.safetensors / .npy) at POINT",
    )
    p.add_argument(
        "--edit-on",
        default="both",
        choices=["both", "prompt", "generated"],
        help="which positions the steering applies to",
    )
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=50)
    p.set_defaults(run=run)


def _read_vector(path: str):
    """A steering vector from a .safetensors file (one tensor) or a .npy file; never a pickle."""
    import numpy as np
    import torch

    from ..errors import HookscopeError

    try:
        if path.endswith(".npy"):
            return torch.from_numpy(np.load(path, allow_pickle=False))
        from safetensors.torch import load_file

        tensors = load_file(path)
    except (OSError, ValueError) as e:
        raise HookscopeError(f"cannot read steering vector {path}: {e}") from e
    except Exception as e:  # safetensors raises its own error type for a malformed file
        raise HookscopeError(
            f"cannot read steering vector {path}: {e} (give a .safetensors or .npy file)"
        ) from e
    if len(tensors) != 1:
        raise HookscopeError(
            f"{path} holds {len(tensors)} tensors ({', '.join(tensors)}); a steering vector "
            "file must hold exactly one"
        )
    return next(iter(tensors.values()))


def _prompts(tok, prompts: list[str], device: str) -> dict:
    from ..errors import HookscopeError

    if tok is None:
        raise HookscopeError("this model has no tokenizer; call hs.generate from Python with token ids")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"  # a decoder continues after the last column
    inputs = dict(tok(prompts, return_tensors="pt", padding=True))
    inputs.pop("token_type_ids", None)
    return {k: v.to(device) for k, v in inputs.items()}


def _options(args, tok) -> dict:
    import torch

    options = {"max_new_tokens": args.max_new_tokens, "pad_token_id": tok.pad_token_id}
    if args.sample:
        torch.manual_seed(args.seed)
        options.update(do_sample=True, temperature=args.temperature, top_k=args.top_k)
    else:
        options.update(do_sample=False)
    return options


def _save(gen, loaded, args) -> None:
    from ..capture import save_tensors

    tensors = dict(gen.activations)
    tensors.update(sequences=gen.sequences.cpu(), mask=gen.mask.cpu())
    metadata = {
        "model": loaded.name,
        "prompt_length": str(gen.prompt_length),
        "positions": str(args.positions),
        "edit_on": args.edit_on,
        "steer": ";".join(f"{p}:{f}:{s}" for p, f, s in args.steer),
    }
    save_tensors(args.out, tensors, metadata=metadata)
    shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in tensors.items())
    print(f"captures written to {args.out}: {shapes}", file=sys.stderr)


def run(args) -> int:
    import torch

    import hookscope as hs

    from ..errors import HookscopeError

    loaded = load(args)
    tok = loaded.tokenizer
    inputs = _prompts(tok, args.prompt, args.device)
    edits = [hs.steer(point, _read_vector(path), scale=scale) for point, path, scale in args.steer]
    points = [p for p in args.points.split(",") if p] if args.points else []
    if args.out and not points:
        raise HookscopeError("--out writes captures: give --points too")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    gen = hs.generate(
        loaded.model,
        inputs,
        points,
        edits=edits,
        edit_on=args.edit_on,
        positions=args.positions,
        dtype=dtype,
        device="cpu",
        **_options(args, tok),
    )
    for prompt, text in zip(args.prompt, gen.text(tok), strict=True):
        print(f"{prompt}{text}")
    if args.out:
        _save(gen, loaded, args)
    return 0
