"""The token mask's gather (hookscope/token_rows.py): the rows a capture keeps are bit for bit
those of the plain reference `act[mask].to(dtype)`, whichever order the gather and the cast run in,
and a mask changed in place between passes is read anew."""

from __future__ import annotations

import pytest
import torch
from helpers import token_ids
from torch import Tensor

import hookscope as hs

DTYPES = [
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.float64, torch.float32),
    (torch.float64, torch.bfloat16),
    (torch.float16, torch.float32),
]


def bits(x: Tensor) -> Tensor:
    """The raw bits of x (NaN payloads and -0.0 included), which `torch.equal` would not compare."""
    return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def awkward(dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
    """Random values across many exponents, with the values a cast can get wrong mixed in: NaNs
    with payloads, infinities, -0.0, subnormals, the largest finite values, rounding ties."""
    g = torch.Generator().manual_seed(0)
    x = (
        torch.randn(shape, generator=g, dtype=torch.float64)
        * torch.exp2(torch.randint(-30, 30, shape, generator=g).double())
    ).to(dtype)
    flat = x.view(-1)
    info = torch.finfo(dtype)
    special = torch.tensor(
        [
            float("nan"),
            float("inf"),
            -float("inf"),
            -0.0,
            info.tiny / 4,
            info.max,
            -info.max,
            1 + 2**-8,
            1 + 3 * 2**-9,
        ],
        dtype=dtype,
    )
    flat[: special.numel()] = special
    raw = bits(flat)
    raw[special.numel()] = raw[0] | 1  # a NaN with another payload
    return x


@pytest.mark.parametrize("src, dst", DTYPES)
def test_cast_then_gather_is_gather_then_cast_bit_for_bit(src, dst):
    """The relation the capture relies on to cast first: a pure dtype cast maps each element on
    its own, so it commutes with any gather of whole elements."""
    x = awkward(src, (6, 50, 16))
    mask = torch.rand(6, 50, generator=torch.Generator().manual_seed(1)) > 0.3
    assert torch.equal(bits(x.to(dst)[mask]), bits(x[mask].to(dst)))
    rows = mask.flatten().nonzero().squeeze(1)
    assert torch.equal(bits(x.to(dst).flatten(0, 1).index_select(0, rows)), bits(x[mask].to(dst)))


class Passthrough(torch.nn.Module):
    """One block that returns its input: the captured activation is exactly the input."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Identity()])

    def forward(self, x: Tensor) -> Tensor:
        return self.layers[0](x)


@pytest.mark.parametrize("src, dst", DTYPES)
@pytest.mark.parametrize("keep", [0.97, 0.1, 1.0, 0.0])  # mostly kept: cast first; few: gather first
def test_capture_keeps_the_reference_bits(src, dst, keep):
    x = awkward(src, (4, 33, 24))
    mask = torch.rand(4, 33, generator=torch.Generator().manual_seed(2)) < keep
    with hs.capture(Passthrough(), "blocks.0.resid_post", token_mask=mask, dtype=dst) as cap:
        cap.model(x)
    got = cap["blocks.0.resid_post"]
    assert got.dtype == dst and got.shape == (int(mask.sum()), 24)
    assert torch.equal(bits(got), bits(x[mask].to(dst)))
    assert got.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_non_contiguous_and_batch_shared_points(gpt2):
    """attn.z with heads (a gathered, permuted tensor), a sliced input (batch and pos not one dim)
    and the batch-shared position embedding: every one equals the plain reference."""
    ids = token_ids(gpt2, batch=3, length=9)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[:, 0], mask[2, 6:] = False, False
    ref = {}
    handles = [
        gpt2.transformer.wpe.register_forward_hook(lambda m, a, o: ref.__setitem__("wpe", o)),
        gpt2.transformer.h[1].register_forward_hook(
            lambda m, a, o: ref.__setitem__("h1", o if isinstance(o, Tensor) else o[0])
        ),
    ]
    try:
        with torch.no_grad():
            gpt2(ids)
    finally:
        for h in handles:
            h.remove()
    got = hs.collect(gpt2, ids, ["pos_embed", "blocks.1.resid_post"], token_mask=mask, dtype=torch.bfloat16)
    shared = ref["wpe"].reshape(-1, 9, 64).expand(3, 9, -1)  # one row of positions for the batch
    assert torch.equal(bits(got["pos_embed"]), bits(shared[mask].to(torch.bfloat16)))
    assert torch.equal(bits(got["blocks.1.resid_post"]), bits(ref["h1"][mask].to(torch.bfloat16)))
    wide = awkward(torch.float32, (4, 10, 48))[:, :, ::2]  # strided last dim
    tall = awkward(torch.float32, (4, 20, 24))[:, ::2]  # strided pos: batch and pos not one dim
    m = torch.rand(4, 10, generator=torch.Generator().manual_seed(3)) > 0.2
    for x in (wide, tall):
        with hs.capture(Passthrough(), "blocks.0.resid_post", token_mask=m, dtype=torch.bfloat16) as cap:
            cap.model(x)
        assert torch.equal(bits(cap["blocks.0.resid_post"]), bits(x[m].to(torch.bfloat16)))


def test_a_mask_changed_in_place_between_passes_is_read_anew():
    x = awkward(torch.float32, (2, 8, 4))
    mask = torch.ones(2, 8, dtype=torch.bool)
    with hs.capture(
        Passthrough(), "blocks.0.resid_post", token_mask=mask, dtype=torch.bfloat16, accumulate=True
    ) as cap:
        cap.model(x)
        mask[:, 3:] = False
        cap.model(x)
    want = torch.cat([x.flatten(0, 1), x[:, :3].flatten(0, 1)]).to(torch.bfloat16)
    assert torch.equal(bits(cap["blocks.0.resid_post"]), bits(want))
