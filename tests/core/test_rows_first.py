"""A view marked `select_rows_first` (a tensor-parallel gather is one): a capture picks its positions
or tokens from the raw tensor before the view, so the view reads the kept rows alone, and keeps
what it keeps with the view read first. Without torchrun: the view here is the family's own heads
split, wrapped to record what it was given; tests/engines/test_tensor_parallel.py checks the real
gather against the unsharded model."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hookscope as hs
from hookscope.arch import arch_of

POINT = "blocks.1.attn.z"
N_HEADS = 4  # hookscope.testing's tiny Llama


def counting_table(model: torch.nn.Module, seen: list[tuple[int, ...]], head_dim: int = -2):
    """The model's table with POINT's view marked, recording the shape of each raw tensor it reads;
    its head dim counted from the end (as the tables give it) or from the start."""
    arch = arch_of(model)
    spec = dataclasses.replace(arch.specs[POINT], head_dim=head_dim)
    view = spec.view

    def get(raw: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(raw.shape[:-1]))
        return view.get(raw)

    marked = dataclasses.replace(view, get=get, select_rows_first=True)
    return dataclasses.replace(arch, specs={**arch.specs, POINT: dataclasses.replace(spec, view=marked)})


def plain_z(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Block 1's o_proj input split into heads, read by a plain pre-forward hook."""
    seen = []
    o_proj = model.model.layers[1].self_attn.o_proj
    handle = o_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0].clone()))
    try:
        with torch.inference_mode():
            model(**batch)
    finally:
        handle.remove()
    return seen[0].unflatten(-1, (N_HEADS, -1))


@pytest.fixture
def batch(llama, make_ids) -> dict:
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, -2:] = 0  # the second row ends in two padding tokens
    return {"input_ids": make_ids(llama), "attention_mask": mask}


@pytest.mark.parametrize("head_dim", [-2, 2])
def test_the_view_reads_only_the_kept_rows_and_keeps_the_same(llama, batch, head_dim):
    z = plain_z(llama, batch)
    mask = batch["attention_mask"].bool()
    cases = {  # selection -> (the rows the view is given, what the plain hook's tensor keeps)
        "positions": ({"positions": [1, 4]}, (2, 2), z[:, [1, 4]]),
        "last": ({"positions": "last"}, (2,), torch.stack([z[0, 6], z[1, 4]])),
        "one position and heads": ({"positions": -1, "heads": [1, 2]}, (2,), z[:, -1, [1, 2]]),
        "token mask, cast": ({"token_mask": mask, "dtype": torch.bfloat16}, (12,), z[mask].bfloat16()),
        "token mask, heads": ({"token_mask": mask, "heads": [3]}, (12,), z[mask][:, [3]]),
    }
    for name, (options, rows, want) in cases.items():
        seen: list[tuple[int, ...]] = []
        table = counting_table(llama, seen, head_dim)
        got = hs.collect(llama, batch, POINT, arch=table, **options)[POINT]
        assert seen == [rows], name
        assert torch.equal(got, want), name


def test_without_rows_selected_the_view_reads_everything(llama, batch):
    seen: list[tuple[int, ...]] = []
    got = hs.collect(llama, batch, POINT, arch=counting_table(llama, seen), heads=[0])[POINT]
    assert seen == [(2, 7)]
    assert torch.equal(got, plain_z(llama, batch)[:, :, [0]])
