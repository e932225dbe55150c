"""`hookscope points [MODEL]`: list hook points, with shapes on a sample sentence (or image)."""

from __future__ import annotations

from .args import DEFAULT_TEXT, encode, load, model_args, quiet_transformers


def add_parser(sub) -> None:
    p = sub.add_parser("points", help="list a model's hook points")
    model_args(p)
    p.add_argument(
        "--text", default=DEFAULT_TEXT, help="sample input for shapes ('' to skip the forward pass)"
    )
    p.add_argument(
        "--pattern", default=None, help="only names matching this glob, e.g. 'blocks.*.resid_post'"
    )
    p.set_defaults(run=run)


def _example(args):
    """(loaded model, sample input or None, the text the shapes are shown on)."""
    import hookscope as hs

    from ..sources import images

    text = args.text
    if images.has_image_processor(args.model):  # a vision encoder: shapes on a sample image
        quiet_transformers()
        loaded = hs.load(args.model, device=args.device, tokenizer=False)
        return loaded, (images.sample_input(args.model, args.device) if args.text else None), text
    loaded = load(args)
    example = encode(loaded, text) if text else None
    heads = loaded.arch.n_heads
    while (
        example is not None
        and args.text == DEFAULT_TEXT
        and heads
        and example["input_ids"].shape[-1] == heads
    ):  # [1, 12, 12, 32] could not be read
        text += " Again."
        example = encode(loaded, text)
    return loaded, example, text


def run(args) -> int:
    import hookscope as hs

    loaded, example, text = _example(args)
    infos = hs.points(loaded.model, example, pattern=args.pattern)
    print(
        f"{loaded.name}: {type(loaded.model).__name__}, family {loaded.arch.family}, "
        f"{loaded.arch.n_layers} blocks, {len(loaded.arch.names)} points"
    )
    if example is not None and "input_ids" in example:  # a vision model's sample image has none
        print(f"shapes on {text!r} ({example['input_ids'].shape[-1]} tokens; --text to change it)")
    width = max(len(i.name) for i in infos)
    means = max(len(i.meaning) for i in infos)
    for i in infos:
        shape = f"  {list(i.shape)}" if i.shape else ""
        where = f"{i.module}:{i.io}" + (f" ({i.view})" if i.view else "")
        print(f"  {i.name:<{width}}  {i.meaning:<{means}}  {where}{shape}".rstrip())
    print("Raw modules too: module:<dotted.path>:input|output (see print(model)).")
    return 0
