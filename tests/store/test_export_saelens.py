"""From a store to a trained SAELens SAE, with the real `sae-lens` (6.54, TransformerLens 3.9):

1. `SAETrainer` fed by `iter(store.dataset(..., repeat=True))`: trains past several epochs with no
   hand-written generator; the SAE's config names the model and hook.
2. `hookscope export --format saelens`: SAELens's own `ActivationsStore` reads the folder (its
   shape checks pass) and hands out exactly the store's rows; its `LanguageModelSAETrainingRunner`
   trains from it and saves an SAE whose config names the model and hook.
"""

from __future__ import annotations

import json

import pytest
import torch
from gate import need
from helpers import tiny_hooked_transformer

need("sae_lens")

from sae_lens import (  # noqa: E402
    LanguageModelSAERunnerConfig,
    LanguageModelSAETrainingRunner,
    LoggingConfig,
    SAETrainer,
    StandardTrainingSAE,
    StandardTrainingSAEConfig,
)
from sae_lens.config import SAETrainerConfig  # noqa: E402
from sae_lens.saes.sae import SAEMetadata  # noqa: E402
from sae_lens.training.activations_store import ActivationsStore  # noqa: E402
from sparse_store import POINT, fvu, make_sparse_store  # noqa: E402

from hookscope.export import export_saelens, tl_hook_name  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_sparse_store(tmp_path_factory.mktemp("sl") / "store", rows=2048, context=16)


def test_sae_trainer_takes_the_endless_dataset(store, tmp_path):
    torch.manual_seed(0)
    cfg = StandardTrainingSAEConfig(
        d_in=32,
        d_sae=128,
        l1_coefficient=0.3,
        metadata=SAEMetadata(
            model_name=store.manifest.settings["model"],
            hook_name=tl_hook_name(POINT),
            context_size=store.manifest.settings["context"],
        ),
    )
    sae = StandardTrainingSAE(cfg)
    x = store.tensor(POINT)
    before = fvu(lambda v: sae.decode(sae.encode(v)), x)
    batch, epochs = 128, 5
    data = store.dataset(POINT, batch_size=batch, drop_last=True, repeat=True)
    cfg = SAETrainerConfig(
        total_training_samples=epochs * len(store),
        train_batch_size_samples=batch,
        lr=3e-3,
        lr_end=3e-3,
        save_final_checkpoint=False,
    )
    trainer = SAETrainer(cfg, sae, iter(data))
    sae = trainer.fit()  # 5 epochs: no StopIteration escapes
    steps = epochs * len(store) // batch
    assert trainer.n_training_steps == steps and trainer.n_training_samples == epochs * len(store)
    assert data.state_dict()["epoch"] == epochs - 1 and data.state_dict()["position"] == len(store)
    after = fvu(lambda v: sae.decode(sae.encode(v)), x)
    assert after < 0.3 * before
    sae.save_model(str(tmp_path / "sae"))
    meta = json.loads((tmp_path / "sae" / "cfg.json").read_text())["metadata"]
    assert (meta["model_name"], meta["hook_name"], meta["context_size"]) == (
        "tiny/sparse-model",
        "blocks.1.hook_resid_post",
        16,
    )
    assert meta["l0"] > 0  # SAELens's own sparsity measurement ran


def test_saelens_reads_the_export_as_its_own_cache(store, tmp_path):
    done = export_saelens(store, tmp_path / "cache", progress=False)
    assert done.sequences == "whole" and done.context_size == 16
    acts_store = ActivationsStore(
        model=None,
        dataset=None,
        streaming=False,
        hook_name=done.hook_name,
        hook_head_index=None,
        context_size=done.context_size,
        d_in=done.d_in,
        n_batches_in_buffer=4,
        total_training_tokens=10**6,
        store_batch_size_prompts=8,
        train_batch_size_tokens=64,
        prepend_bos=False,
        normalize_activations="none",
        device=torch.device("cpu"),
        dtype="float32",
        cached_activations_path=done.path,
    )
    rows = store.tensor(POINT)
    tokens = store.tensor("token_ids")
    for i in range(3):  # SAELens's reader walks the examples in order: 8 sequences of 16 rows each
        acts, token_ids = acts_store.get_raw_llm_batch()
        s = slice(i * 128, (i + 1) * 128)
        assert torch.equal(acts, rows[s]) and torch.equal(token_ids.long(), tokens[s])


def test_the_training_runner_trains_from_the_export(store, tmp_path):
    from datasets import load_from_disk

    done = export_saelens(store, tmp_path / "cache", progress=False)
    # the runner wants a model and a token dataset for its evaluations (off here: no wandb); the
    # activations come from the cache. The token ids of the export serve as that dataset.
    model = tiny_hooked_transformer(n_ctx=16, d_vocab=500)
    tokens = load_from_disk(done.path).select_columns(["token_ids"]).rename_column("token_ids", "tokens")
    cfg = LanguageModelSAERunnerConfig(
        sae=StandardTrainingSAEConfig(d_in=done.d_in, d_sae=128, l1_coefficient=0.3),
        **done.runner_kwargs(),
        training_tokens=3 * done.rows_exported,
        train_batch_size_tokens=128,
        store_batch_size_prompts=8,
        n_batches_in_buffer=16,
        lr=3e-3,
        exclude_special_tokens=False,
        output_path=str(tmp_path / "out"),
        logger=LoggingConfig(log_to_wandb=False),
    )
    sae = LanguageModelSAETrainingRunner(cfg, override_model=model, override_dataset=tokens).run()
    saved = json.loads((tmp_path / "out" / "cfg.json").read_text())["metadata"]
    assert (saved["model_name"], saved["hook_name"], saved["context_size"]) == (
        "tiny/sparse-model",
        "blocks.1.hook_resid_post",
        16,
    )
    assert fvu(lambda v: sae.decode(sae.encode(v)), store.tensor(POINT)) < 0.5
