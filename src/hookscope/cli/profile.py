"""`hookscope profile [MODEL]`: time and memory per block, a trace, a picture."""

from __future__ import annotations

from .args import DTYPES, at_least, model_args, points_arg, quiet_transformers


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="where time and memory go, per block and hooked point")
    model_args(p)
    p.add_argument("--batch", type=at_least(1), default=8)
    p.add_argument(
        "--seq", type=at_least(1), default=128, help="tokens per sequence (at most the model's positions)"
    )
    p.add_argument("--backward", action="store_true", help="profile forward + backward")
    p.add_argument(
        "--compile",
        default=None,
        choices=["off", "blocks", "full"],
        help="compile policy (default: $HOOKSCOPE_COMPILE, else off)",
    )
    p.add_argument("--dtype", default=None, choices=DTYPES)
    p.add_argument("--steps", type=at_least(1), default=5)
    p.add_argument("--warmup", type=at_least(0), default=2)
    p.add_argument("--out", default=None, help="write table, trace, picture and HTML page here")
    points_arg(
        p,
        help="load only the weights these points need, and profile as far as they go "
        "(for a model too big to load whole)",
    )
    p.set_defaults(run=run)


def run(args) -> int:
    import hookscope as hs

    from ..compiling import compile_stats, reset_stats
    from ..profiling import random_tokens
    from ..profiling.report import writable_dir

    quiet_transformers()
    if args.out:
        writable_dir(args.out)  # before minutes of profiling, not after
    loaded = hs.load(
        args.model, device=args.device, dtype=args.dtype, compile_policy=args.compile, points=args.points
    )
    inputs = random_tokens(loaded.model, args.batch, args.seq, device=args.device)
    reset_stats()
    report = hs.profile(loaded.model, inputs, backward=args.backward, steps=args.steps, warmup=args.warmup)
    report.compile_stats = compile_stats()  # graph breaks and recompiles, shown in the summary
    print(report.summary(), flush=True)  # first: whatever happens to the files, the profile is shown
    if args.out:
        files = report.write(args.out)
        names = ", ".join(
            p.name + (" (chrome://tracing or ui.perfetto.dev)" if kind == "trace" else "")
            for kind, p in files.items()
        )
        print(f"files in {args.out}: {names}")
    return 0
