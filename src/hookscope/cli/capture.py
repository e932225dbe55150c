"""`hookscope capture [MODEL] --points P`: capture point(s) on a sentence and summarise them."""

from __future__ import annotations

from .args import DEFAULT_TEXT, DTYPES, encode, load, model_args, points_arg, positions


def add_parser(sub) -> None:
    p = sub.add_parser("capture", help="capture point(s) on one sentence and summarise them")
    model_args(p)
    points_arg(p, required=True, help="point name(s), comma-separated or a glob")
    p.add_argument("--text", default=DEFAULT_TEXT)
    p.add_argument("--positions", type=positions, default=None, help="all | last | N | A:B | i,j,k")
    p.add_argument("--dtype", default=None, choices=DTYPES)
    p.add_argument("--save", default=None, help="write the captures to this .safetensors file")
    p.set_defaults(run=run)


def run(args) -> int:
    import torch

    import hookscope as hs

    from ..capture import save_tensors

    loaded = load(args, points=args.points)  # the pass stops after them: nothing later is read
    inputs = encode(loaded, args.text)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    acts = hs.collect(loaded.model, inputs, args.points, positions=args.positions, dtype=dtype)
    tokens = loaded.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0])
    print(f"{loaded.name} on {args.text!r} ({len(tokens)} tokens: {' '.join(tokens)})")
    for name, act in acts.items():
        x = act.float()
        print(
            f"  {name}: shape {list(act.shape)} {act.dtype}  mean {x.mean():+.4f}  std {x.std():.4f}  "
            f"max |x| {x.abs().max():.4f}"
        )
    if args.save:
        save_tensors(args.save, acts)
        print(f"  saved to {args.save}")
    return 0
