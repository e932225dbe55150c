"""The `hookscope` command. Thin: it parses arguments and calls the rooms; no logic lives here.
One module per command, each with `add_parser(sub)` and `run(args)`; `args.py` holds what they share.

    hookscope points [MODEL]                 list hook points (with shapes on a sample sentence)
    hookscope capture [MODEL] --points P     capture point(s) on a sentence and summarise them
    hookscope extract [MODEL] --out DIR      stream points of a dataset to a sharded store
    hookscope inspect DIR                    summarise and verify a store
    hookscope profile [MODEL]                time and memory per block, trace, picture
    hookscope top DIR --point P --unit N     the contexts where a unit (or SAE feature) is largest
    hookscope generate MODEL --prompt TEXT   generate text, capturing / steering points on the way
    hookscope export DIR --format F --out O  a store as SAELens's cache or a `datasets` folder
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import capture, export, extract, generate, inspect, points, profile, top

# in the order `hookscope --help` lists them
COMMANDS = (points, capture, extract, profile, top, generate, export, inspect)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hookscope", description="Look inside PyTorch models.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from ..errors import HookscopeError

    args = build_parser().parse_args(argv)
    try:
        code = args.run(args)
        sys.stdout.flush()  # here, so that a closed pipe is caught below and not at interpreter exit
        return code
    except HookscopeError as exc:
        print(f"hookscope: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `hookscope inspect DIR | head`: the reader left; that is not an error
        # point stdout at /dev/null so the interpreter's final flush does not raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
