"""One rank of tests/engines/test_tp_points.py, a child of the fork server with torchrun's
environment (tests/kit/forkserver.py, `call_ranks`): each model directory loaded with
`hs.load(dir, tp=2, points=POINTS)` and with `tp=2` alone, what the verbs gave, which parameters
left `meta`, each rank's bytes of them and what the refused asks said, saved to
OUT/<case>.rank<R>.pt; then `hookscope extract --tp 2` with the model it loaded recorded. Nothing
is compared here: the parent compares with the unsharded model."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import hookscope as hs

# shared with the parent test: two split points, two whole ones, blocks 0-1 of 4
POINTS = ["blocks.0.attn.out", "blocks.1.attn.z", "blocks.1.mlp.post", "blocks.1.resid_post"]
SPLIT = ["blocks.1.attn.z", "blocks.1.mlp.post"]
PAST = "blocks.2.resid_post"
VOCAB = 300


def inputs(seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(seed))


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def held(model: torch.nn.Module) -> dict[str, int]:
    """Parameter name -> this rank's bytes of it, for the parameters that left `meta`."""
    found = {}
    for name, param in model.named_parameters():
        mine = local_tensor(param)
        if not mine.is_meta:
            found[name] = mine.nbytes
    return found


def refusal(ask: Callable[[], Any]) -> str | None:
    try:
        ask()
    except hs.PointNotLoadedError as exc:
        return str(exc)
    return None


def unstopped_pass(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """A capture whose pass is not stopped after its point: it runs on into block 2."""
    with hs.capture(model, "blocks.1.resid_post"), torch.inference_mode():
        model(ids)


def run_case(directory: str) -> dict:
    options = {"tokenizer": False, "attn_implementation": "eager", "dtype": torch.float32}
    model = hs.load(directory, tp=2, points=POINTS, **options).model
    ids = inputs(0)
    out: dict = {"acts": dict(hs.collect(model, ids, POINTS))}
    with hs.capture(model, POINTS) as cap:
        cap.run(ids)  # stopped after block 1
    out["captured"] = {name: cap[name] for name in POINTS}
    out["kept"] = dict(hs.collect(model, ids, SPLIT, gather=False))
    out["held"] = held(model)
    out["refused"] = refusal(lambda: hs.collect(model, ids, [*POINTS, PAST]))
    out["pass_refused"] = refusal(lambda: unstopped_pass(model, ids))
    out["grads_refused"] = refusal(lambda: hs.grads(model, ids, POINTS[-1], lambda o: o.logits.sum()))
    out["generate_refused"] = refusal(lambda: hs.generate(model, ids, POINTS[-1], max_new_tokens=2))
    # the verbs that run as far as the weights go: shapes measured, blocks profiled
    out["shapes"] = {info.name: info.shape for info in hs.points(model, ids)}
    report = hs.profile(model, ids, steps=1, warmup=0)
    out["profiled"] = [row.name for row in report.block_rows()]
    whole = hs.load(directory, tp=2, **options).model
    out["whole_held"] = held(whole)
    # a point after the last block: every weight is needed, and the output is there
    through = hs.load(directory, tp=2, points=["logits"], **options).model
    out["through_held"] = held(through)
    out["logits"] = hs.collect(through, ids, "logits")["logits"]
    return out


def run_extract(args: list[str]) -> dict:
    """`hookscope args...`, with the parameters and bytes of the model the extraction loaded."""
    from hookscope.cli import main
    from hookscope.extract import loop

    seen: dict = {}
    real_load = loop.load

    def recording_load(*a: Any, **k: Any):
        loaded = real_load(*a, **k)
        seen["held"] = held(loaded.model)
        return loaded

    loop.load = recording_load
    try:
        seen["code"] = main(args)
    finally:
        loop.load = real_load
    return seen


def run(out: str, cases: dict[str, str], extract_args: list[str]) -> dict:
    rank = int(os.environ["RANK"])
    for case, directory in cases.items():
        torch.save(run_case(directory), Path(out) / f"{case}.rank{rank}.pt")
    found = run_extract(extract_args)
    dist.barrier()
    return found
