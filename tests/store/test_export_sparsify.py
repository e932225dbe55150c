"""From a store to a trained sparsify (`eai-sparsify` 1.3) TopK sparse coder.

sparsify's own `Trainer` runs the model itself (it takes a model and a token dataset), so from
stored activations the path is its `SparseCoder` in a short loop over
`store.dataset(..., repeat=True)`, the same steps its trainer takes (FVU + AuxK loss, gradient
parallel to the decoder rows removed, decoder rows renormalised); docs/examples/sae_from_store.md
shows this loop.
"""

from __future__ import annotations

from itertools import islice

import torch
from gate import need

sparsify = need("sparsify")

from sparse_store import POINT, fvu, make_sparse_store  # noqa: E402


def test_a_sparse_coder_trains_from_the_store(tmp_path):
    store = make_sparse_store(tmp_path / "store", rows=2048)
    torch.manual_seed(0)
    coder = sparsify.SparseCoder(32, sparsify.SparseCoderConfig(num_latents=128, k=4))
    opt = torch.optim.Adam(coder.parameters(), lr=3e-3)
    x = store.tensor(POINT)

    def reconstruct(v):
        return coder(v).sae_out

    before = fvu(reconstruct, x)
    data = store.dataset(POINT, batch_size=128, drop_last=True, repeat=True)
    steps = 6 * len(data)  # six epochs through one iterator
    fired = torch.zeros(128, dtype=torch.bool)
    for batch in islice(iter(data), steps):
        out = coder(batch, dead_mask=~fired if fired.any() else None)
        fired[out.latent_indices.flatten()] = True
        loss = out.fvu + out.auxk_loss / 32
        loss.backward()
        coder.remove_gradient_parallel_to_decoder_directions()
        opt.step()
        opt.zero_grad()
        coder.set_decoder_norm_to_unit_norm()
    assert data.state_dict()["epoch"] == 5 and data.state_dict()["position"] == len(store)
    after = fvu(reconstruct, x)
    assert after < 0.6 * before  # 0.63 -> 0.29 here
    # it saves and loads back as sparsify's own format
    coder.save_to_disk(tmp_path / "coder")
    loaded = sparsify.SparseCoder.load_from_disk(tmp_path / "coder")
    assert torch.equal(loaded(x[:64]).sae_out, coder(x[:64]).sae_out)
