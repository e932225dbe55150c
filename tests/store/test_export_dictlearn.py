"""From a store to a trained dictionary_learning (`dictionary-learning` 0.1) SAE with its own
`trainSAE`, which iterates whatever it is given: the endless dataset itself, no generator.

dictionary_learning pins nnsight < 0.4, which pulls torchvision: it lives in its own test
environment (`scripts/test-all dictlearn`). In any other environment this file is skipped, saying
so; in that one (HOOKSCOPE_REQUIRE=dictionary_learning, tests/kit/gate.py) a failed import is an error.
"""

from __future__ import annotations

import torch
from gate import need

need("dictionary_learning")

from dictionary_learning.dictionary import AutoEncoder  # noqa: E402
from dictionary_learning.trainers.standard import StandardTrainer  # noqa: E402
from dictionary_learning.training import trainSAE  # noqa: E402
from sparse_store import POINT, fvu, make_sparse_store  # noqa: E402


def test_train_sae_runs_every_step_over_several_epochs(tmp_path):
    store = make_sparse_store(tmp_path / "store", rows=2048)
    data = store.dataset(POINT, batch_size=128, drop_last=True, repeat=True)
    steps = 5 * len(data) + 3  # the reported failure: trainSAE stopped silently after one epoch
    torch.manual_seed(0)
    trainSAE(
        data=data,
        steps=steps,
        device="cpu",
        save_dir=str(tmp_path / "run"),
        trainer_configs=[
            {
                "trainer": StandardTrainer,
                "dict_class": AutoEncoder,
                "activation_dim": 32,
                "dict_size": 128,
                "lr": 3e-3,
                "l1_penalty": 0.05,
                "warmup_steps": 10,
                "sparsity_warmup_steps": 10,
                "seed": 0,
                "device": "cpu",
                "layer": 1,
                "lm_name": store.manifest.settings["model"],
                "steps": steps,
            }
        ],
    )
    # trainSAE takes one batch more than `steps` (it breaks on the first one past the end)
    consumed = steps + 1
    assert data.state_dict()["epoch"] == consumed // len(data)
    assert data.state_dict()["position"] == (consumed % len(data)) * 128
    ae = AutoEncoder.from_pretrained(str(tmp_path / "run" / "trainer_0" / "ae.pt"), device="cpu")
    x = store.tensor(POINT)
    fresh = AutoEncoder(32, 128)
    assert fvu(ae, x) < 0.3 * fvu(fresh, x)
