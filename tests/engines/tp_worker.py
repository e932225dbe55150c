"""One torchrun rank of tests/engines/test_tensor_parallel.py: each model directory given loaded
with `hs.load(dir, tp=2)`, every verb run on it, and what it gave saved to OUT/<dir name>.rank<R>.pt
for the parent test to compare with the unsharded model. Nothing is compared here: the reference
is computed in the parent, with plain module hooks, from the same directory."""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

import hookscope as hs
from hookscope.engines import tensor_parallel as tp

# shared with the parent test (imported there from this file)
GRAD_POINTS = ["blocks.0.resid_post", "blocks.1.attn.z", "blocks.1.mlp.post"]
VOCAB = 300
RAW_POINTS = ["module:model.layers.1.mlp.down_proj:input", "module:model.layers.1.self_attn.o_proj:input"]


def inputs(seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(seed))


def loss(output) -> torch.Tensor:
    return output.logits.log_softmax(-1)[:, -1, 5].sum() + output.logits.pow(2).mean()


def steering_vector(d_model: int) -> torch.Tensor:
    return torch.randn(d_model, generator=torch.Generator().manual_seed(2))


def padded(seed: int) -> dict[str, torch.Tensor]:
    """A batch whose second row ends in two padding tokens."""
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, -2:] = 0
    return {"input_ids": inputs(seed), "attention_mask": mask}


SELECTED_POINTS = ["blocks.1.attn.z", "blocks.1.mlp.post", "blocks.1.attn.k", "blocks.1.resid_post"]


def selections() -> dict[str, dict]:
    """Selections of rows (each beside heads, a cast or nothing more) asked of the sharded model and
    of the unsharded one alike, on `padded(0)`."""
    return {
        "positions": {"positions": [1, 4]},
        "last": {"positions": "last", "dtype": torch.bfloat16},
        "one position, heads": {"positions": -1, "heads": [1, 2], "points": ["blocks.1.attn.z"]},
        "slice": {"positions": slice(2, None, 2)},
        "token mask": {"token_mask": padded(0)["attention_mask"].bool()},
    }


GATHERED_ROWS = {"every row": {}, "positions [1, 4]": {"positions": [1, 4]}, "last": {"positions": "last"}}


def run(directory: str) -> dict:
    loaded = hs.load(directory, tp=2, tokenizer=False, attn_implementation="eager", dtype=torch.float32)
    model, arch = loaded.model, loaded.arch
    out_mapped = mapped_weight_files(directory)
    ids, other = inputs(0), inputs(1)
    out: dict = {"points": [(p.name, p.view) for p in hs.points(model)], "mapped": out_mapped}
    out["local_bytes"] = sum(local_tensor(p).nbytes for p in model.parameters())
    out["generation_max_length"] = model.generation_config.max_length
    out["name_or_path"] = model.config.name_or_path
    out["layout"] = {n: (s.describe() if s is not None else None) for n, s in tp.layout(model).items()}
    sharded = [n for n, s in out["layout"].items() if s is not None]

    with torch.inference_mode():
        model(ids)  # warm-up: the first pass builds caches
        start = time.perf_counter()
        model(ids)
        out["forward_s"] = time.perf_counter() - start
    start = time.perf_counter()
    out["acts"] = dict(hs.collect(model, ids, arch.names))
    out["collect_s"] = time.perf_counter() - start
    out["raw"] = dict(hs.collect(model, ids, RAW_POINTS))  # raw module points: the same rule
    out["heads"] = dict(hs.collect(model, ids, "blocks.1.attn.z", heads=[1, 2]))
    out["kept"] = dict(hs.collect(model, ids, sharded, gather=False))
    with hs.capture(model, ["blocks.1.attn.q", "blocks.1.mlp.out"]) as cap:
        with torch.inference_mode():
            model(ids)
    out["captured"] = {k: cap[k] for k in cap}
    with hs.capture(model, ["blocks.1.attn.q", "blocks.1.mlp.post"], gather=False) as kept:
        with torch.inference_mode():
            model(ids)
    out["captured_kept"] = {k: kept[k] for k in kept}

    out["grads"] = dict(hs.grads(model, ids, GRAD_POINTS, loss))
    out["kept_grads"] = dict(hs.grads(model, ids, GRAD_POINTS, loss, gather=False))
    clean = hs.collect(model, other, ["blocks.0.mlp.post", "blocks.1.attn.z"])
    edits = {
        "steer": hs.steer("blocks.1.resid_post", steering_vector(arch.d_model), scale=3.0),
        "ablate": hs.ablate("blocks.1.attn.z", heads=[0, 3]),
        "patch_mlp": hs.patch("blocks.0.mlp.post", clean),
        "patch_heads": hs.patch("blocks.1.attn.z", clean, heads=[1, 2], positions=[2, 3]),
    }
    out["edited"] = {}
    for name, edit in edits.items():
        with hs.edit(model, edit), torch.inference_mode():
            out["edited"][name] = model(ids).logits
    # generation: greedy steps with a capture at a sharded point and a head ablation at every step
    out["generated"] = generate(model)
    out["profiled"] = profiled(model, ids)
    out["refused"] = refusals(model, ids)
    out["gathers"] = gathers_per_collect(model, ids)
    out["selected"] = {
        name: dict(hs.collect(model, padded(0), options.pop("points", SELECTED_POINTS), **options))
        for name, options in selections().items()
    }
    out["gathered_bytes"] = gathered_bytes(model)
    out["vmhwm_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out["user_loaded"] = user_loaded(directory, ids)
    return out


def refusals(model, ids) -> dict[str, str]:
    """What gather=False beside an option it cannot serve says, each refused before any pass."""
    said = {}
    asks = {
        "heads": lambda: hs.collect(model, ids, "blocks.1.attn.z", gather=False, heads=[0]),
        "arch": lambda: hs.capture(model, "blocks.1.attn.z", gather=False, arch=tp.sharded(model)),
    }
    for name, ask in asks.items():
        try:
            ask()
        except hs.TensorParallelError as exc:
            said[name] = str(exc)
    return said


GATHER_ASKS = {  # points asked -> how many of them are split over the ranks
    "whole": (["blocks.0.resid_post", "blocks.1.attn.out", "blocks.1.mlp.out"], 0),
    "one split": (["blocks.1.attn.z", "blocks.1.resid_post"], 1),
    "every block's mlp.post": (["blocks.*.mlp.post"], 2),
}


@contextlib.contextmanager
def counted_gathers() -> Iterator[list[int]]:
    """The bytes this rank sent in each `dist.all_gather` while the block runs (the model's own
    collectives are DTensor's functional ones, not `dist.all_gather`)."""
    sent: list[int] = []
    real = dist.all_gather

    def counting(parts, tensor, *args, **kwargs):
        sent.append(tensor.nbytes)
        return real(parts, tensor, *args, **kwargs)

    dist.all_gather = counting
    try:
        yield sent
    finally:
        dist.all_gather = real


def gathers_per_collect(model, ids) -> dict[str, int]:
    """How many all-gathers one `hs.collect` of each GATHER_ASKS entry ran."""
    found = {}
    for name, (points, _) in GATHER_ASKS.items():
        with counted_gathers() as sent:
            hs.collect(model, ids, points)
        found[name] = len(sent)
    return found


def gathered_bytes(model) -> dict[str, int]:
    """The bytes this rank sent to gather `blocks.1.mlp.post` under each GATHERED_ROWS selection."""
    found = {}
    for name, options in GATHERED_ROWS.items():
        with counted_gathers() as sent:
            hs.collect(model, padded(0), "blocks.1.mlp.post", **options)
        found[name] = sum(sent)
    return found


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def mapped_weight_files(directory: str) -> list[str]:
    """The lines of /proc/self/maps that map one of the directory's weight files: the pages a
    memory map read stay resident in the process while it lives."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return [line for line in lines if str(Path(directory).resolve()) in line]


def generate(model) -> dict:
    gen = hs.generate(
        model,
        inputs(3),
        ["blocks.1.attn.z", "blocks.1.mlp.post"],
        edits=[hs.ablate("blocks.0.attn.z", heads=[1, 2])],
        max_new_tokens=4,
        do_sample=False,
    )
    return {"sequences": gen.sequences, **{k: gen[k] for k in gen.activations}}


def profiled(model, ids: torch.Tensor) -> dict:
    """hs.profile on the sharded model: its rows, and what a user's hook at a sharded point got."""
    seen = []
    report = hs.profile(
        model, ids, steps=1, warmup=1, hooks=[("blocks.1.attn.z", lambda act, hook: seen.append(act.clone()))]
    )
    return {"rows": [(row.kind, row.name) for row in report.rows], "hooked": seen[-1]}


def every_point(directory: str) -> dict:
    """Only every point collected, for the families whose other verbs the full run covers."""
    loaded = hs.load(directory, tp=2, tokenizer=False, attn_implementation="eager", dtype=torch.float32)
    return {
        "acts": dict(hs.collect(loaded.model, inputs(0), loaded.arch.names)),
        "local_bytes": sum(local_tensor(p).nbytes for p in loaded.model.parameters()),
    }


def user_loaded(directory: str, ids: torch.Tensor) -> dict:
    """A model the user sharded with transformers' own `tp_plan`, not through hs.load."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        directory, tp_plan="auto", attn_implementation="eager", dtype=torch.float32
    ).eval()
    return dict(hs.collect(model, ids, ["blocks.1.attn.z", "blocks.1.mlp.post", "blocks.1.resid_post"]))


def main(out_dir: str, *directories: str) -> None:
    """Each directory gets the full run; one given as `points:DIR` only every point collected."""
    for directory in directories:
        result = (
            every_point(directory.removeprefix("points:"))
            if directory.startswith("points:")
            else run(directory)
        )
        directory = directory.removeprefix("points:")
        torch.save(result, Path(out_dir) / f"{Path(directory).name}.rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
