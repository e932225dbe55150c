"""Names mean what TransformerLens means: for every family the TransformerLens 4 bridge boots,
every point hookscope's Hugging Face table and the bridge both have is compared value for value,
on the same tiny checkpoint (family_models' weights, saved with a tokenizer trained offline).

The reference is the bridge's own `run_with_cache`; hookscope reads a plain Hugging Face model
loaded again from the same directory (eager attention, as the bridge forces). Which bridge
HookPoint a name is: the bridge table's own point name (TransformerLens spellings folded, e.g.
`blocks.0.hook_mlp_out` -> `blocks.0.mlp.out`, `blocks.0.mlp.hook_in` -> `blocks.0.mlp.in`), plus
the few names TransformerLens has no spelling of its own for (BRIDGE_ONLY). Float32 on both sides,
computed by different code (the bridge reimplements norms and attention): tolerance 2e-5.

Families: the 19 decoder cases of CASES, BERT and ViT (below). CLIP, SigLIP and DINOv2 are not
compared: TransformerLens 4.3 has no adapter for them (model_bridge/supported_architectures).

Runs in the tl4 environment (TransformerLens 4 cannot share a venv with 3.9); elsewhere it skips.
"""

from __future__ import annotations

import re

import family_models
import pytest
import torch
from gate import need

import hookscope as hs
from hookscope.arch import arch_of
from hookscope.testing import train_tokenizer

need("tl4")

from transformer_lens.model_bridge import TransformerBridge  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

TOL = 2e-5
# every decoder case of family_models the bridge boots (see test_cases_the_bridge_does_not_boot)
CASES = [
    "gpt2",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "olmo",
    "olmo2",
    "neox_parallel",
    "neox_sequential",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "mamba",
    "falcon_mamba",
    "rwkv",
]
# hookscope name suffix -> the bridge's spelling of the same point, compared wherever the bridge has
# that spelling: names TransformerLens 3 lacks, and names the bridge's table files under another
# spelling of one HookPoint (OLMo 2's mlp.hook_in is also its hook_resid_mid: it has no ln2; a MoE
# block's mlp.hook_in is also its mlp.hook_pre)
BRIDGE_ONLY = {
    "attn.in": ("attn.hook_in",),
    "mlp.in": ("mlp.hook_in", "hook_channel_mix_in"),
    "attn.out_pre_norm": ("attn.hook_out",),
    "mlp.out_pre_norm": ("mlp.hook_out",),
    "mlp.router.logits": ("mlp.gate.hook_out",),
    "mlp.router.indices": ("mlp.hook_expert_indices",),
    # Mamba's mixer, RWKV's time mixing (mixer) and channel mixing (mlp)
    "mixer.in": ("hook_mixer_in", "hook_time_mix_in"),
    "mixer.out": ("hook_mixer_out", "hook_time_mix_out"),
    "mlp.out": ("hook_mlp_out", "hook_channel_mix_out"),
}
# names whose meaning differs from a bridge HookPoint of the same folded name, on purpose: Mamba's
# mixer.ssm_out is the gated scan output entering out_proj (d_inner wide, the bridge's
# mixer.out_proj.hook_in); the bridge's mixer.hook_ssm_out is another spelling of its mixer output
NOT_THE_BRIDGES = {"mixer.ssm_out": ("mixer.out_proj.hook_in",)}
BRIDGE_LACKS = re.compile(r"\.mlp\.(experts\.|router\.(weights|routing)|shared\.)")
# the names whose meaning this issue is about: each must be compared wherever hookscope has it
MUST = (
    "resid_pre",
    "attn.in",
    "ln1.normalized",
    "ln1.scale",
    "attn.out",
    "attn.out_pre_norm",
    "resid_mid",
    "ln2.normalized",
    "ln2.scale",
    "mlp.in",
    "mlp.out",
    "mlp.out_pre_norm",
    "resid_post",
    "mixer.in",
    "mixer.out",
    "ln_final",
    "ln_final.normalized",
    "ln_final.scale",
)


def save(case: str, directory) -> str:
    """family_models' tiny model of `case` in float32, with a byte-level BPE tokenizer."""
    model = family_models.build(case).float()
    model.save_pretrained(directory)
    train_tokenizer(family_models.VOCAB).save_pretrained(directory)
    return str(directory)


def boot(path: str) -> TransformerBridge:
    hf = AutoModelForCausalLM.from_pretrained(path)
    return TransformerBridge.boot_transformers(
        path, hf_model=hf, tokenizer=AutoTokenizer.from_pretrained(path), device="cpu"
    ).eval()


def pairs(bridge: TransformerBridge, cache_keys, ours: list[str]) -> dict[str, str]:
    """hookscope name -> the bridge's cache key for the same point, for every name both have."""
    battery = arch_of(bridge)
    by_point: dict[str, str] = {}
    for key in cache_keys:
        try:
            by_point.setdefault(battery.spec(key).name, key)
        except hs.UnknownPointError:  # a vision bridge is not probed: its gated points stay optional
            continue
    found = {name: by_point[name] for name in ours if name in by_point}
    for name in ours:
        suffix = re.sub(r"^blocks\.\d+\.", "", name)
        for spelling in {**BRIDGE_ONLY, **NOT_THE_BRIDGES}.get(suffix, ()):
            spelling = name[: len(name) - len(suffix)] + spelling
            if spelling in cache_keys:
                found[name] = spelling
                break
    return found


def compare(case: str, tmp_path, mutate=None) -> tuple[dict[str, str], list[str]]:
    """(the pairs compared, the names that differ) for one case; `mutate(arch)` changes the Hugging
    Face table first (a broken entry, on purpose)."""
    path = save(case, tmp_path / case)
    bridge = boot(path)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    if mutate:
        mutate(arch_of(hf))
    ids = torch.randint(1, family_models.VOCAB - 50, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(ids)
    names = arch_of(hf).names
    matched = pairs(bridge, list(cache.keys()), names)
    got = hs.collect(hf, ids, list(matched) + ["logits"])
    wrong = []
    for name, key in matched.items():
        theirs = cache[key]
        if name == "pos_embed":  # Hugging Face embeds positions once, broadcast over the batch
            theirs = theirs[:1]
        if got[name].shape != theirs.shape or not torch.allclose(got[name], theirs, atol=TOL, rtol=TOL):
            diff = (got[name] - theirs).abs().max().item() if got[name].shape == theirs.shape else "shape"
            wrong.append(f"{name} vs {key}: {diff}")
    if not torch.allclose(got["logits"], logits, atol=TOL, rtol=TOL):
        wrong.append("logits")
    return matched, wrong


@pytest.mark.parametrize("case", CASES)
def test_every_shared_name_equals_the_bridge(case, tmp_path):
    matched, wrong = compare(case, tmp_path)
    assert not wrong, "\n".join(wrong)
    hf_names = arch_of(family_models.build(case)).names
    must = [n for n in hf_names if re.sub(r"^blocks\.\d+\.", "", n) in MUST]
    assert set(must) <= set(matched), f"not compared: {sorted(set(must) - set(matched))}"
    # every other name is compared too, but for what the bridge has no HookPoint for: inside a MoE
    # block, the experts' own rows, the top-k weights and Qwen2-MoE's shared expert
    left = [n for n in set(hf_names) - set(matched) - {"logits"} if not BRIDGE_LACKS.search(n)]
    assert not left, sorted(left)


@pytest.mark.parametrize(
    "case, point, wrong",
    [
        ("gemma2", "blocks.1.mlp.out", ("layers.1.mlp", "output")),  # the meaning before the fix
        ("olmo2", "blocks.0.attn.out", ("layers.0.self_attn", "output")),
        ("llama", "blocks.1.mlp.in", ("layers.1.post_attention_layernorm", "input")),  # before ln2
        ("llama", "ln_final.normalized", ("norm", "output")),  # after the norm's weight: ln_final
        ("gpt2", "ln_final", ("h.1", "output")),  # before the final norm
    ],
)
def test_a_broken_entry_fails(case, point, wrong, tmp_path):
    import dataclasses

    def mutate(arch):
        spec = arch.specs[point]
        base = "transformer." if case == "gpt2" else "model."
        arch.specs[point] = dataclasses.replace(spec, module=base + wrong[0], io=wrong[1], view=None, item=0)

    _, differ = compare(case, tmp_path, mutate)
    assert [w.split(" vs ")[0] for w in differ] == [point]


# BERT, on the bridge over BertForMaskedLM: the names compared equal, but for three the bridge's
# component boundaries give another tensor than hookscope's (and TransformerLens 3's HookedEncoder)
# meaning: its `hook_embed` is the embeddings' LayerNorm output (hookscope: the word embeddings), its
# `attn.hook_out` is Hugging Face's BertAttention output, after the residual add and LayerNorm
# (hookscope: the output projection's, before the add), its `ln2.hook_in` / `hook_resid_mid` the
# output LayerNorm's input in the MLP sublayer. Asserted to differ, so a change on either side shows.
BERT_DIFFERS = {"embed", "blocks.0.attn.out", "blocks.1.attn.out", "blocks.0.resid_mid", "blocks.1.resid_mid"}


def test_bert_names_equal_the_bridge_but_three(tmp_path):
    from transformers import AutoModel, AutoModelForMaskedLM

    path = tmp_path / "bert"
    family_models.build("bert").float().save_pretrained(path)
    train_tokenizer(family_models.VOCAB, bert=True).save_pretrained(path)
    bridge = TransformerBridge.boot_transformers(
        str(path),
        hf_model=AutoModelForMaskedLM.from_pretrained(path),
        tokenizer=AutoTokenizer.from_pretrained(path),
        device="cpu",
    ).eval()
    hf = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    ids = family_models.inputs("bert")["input_ids"]
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids)
    names = arch_of(hf).names
    matched = pairs(bridge, list(cache.keys()), names)
    assert set(names) == set(matched)
    got = hs.collect(hf, ids, names)
    theirs = {n: cache[key][:1] if n == "pos_embed" else cache[key] for n, key in matched.items()}
    differ = {
        n
        for n in matched
        if got[n].shape != theirs[n].shape or not torch.allclose(got[n], theirs[n], atol=TOL, rtol=TOL)
    }
    assert differ == BERT_DIFFERS


def test_vit_names_equal_the_bridge(tmp_path):
    """ViT, on the bridge over ViTForImageClassification: every name both have (all but patch_embed,
    which the bridge has no HookPoint for) equal."""
    from transformers import AutoModel, ViTForImageClassification

    path = tmp_path / "vit"
    family_models.build("vit").float().save_pretrained(path)
    bridge = TransformerBridge.boot_transformers(
        str(path), hf_model=ViTForImageClassification.from_pretrained(path), device="cpu"
    ).eval()
    hf = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    pixels = family_models.inputs("vit")["pixel_values"].float()
    with torch.no_grad():
        _, cache = bridge.run_with_cache(pixels)
    names = arch_of(hf).names
    matched = pairs(bridge, list(cache.keys()), names)
    assert set(names) - set(matched) == {"patch_embed"}
    got = hs.collect(hf, {"pixel_values": pixels}, list(matched))
    wrong = [
        n
        for n, key in matched.items()
        if got[n].shape != cache[key].shape or not torch.allclose(got[n], cache[key], atol=TOL, rtol=TOL)
    ]
    assert not wrong


def test_the_final_norm_names_and_the_meaning_a_bridge_store_records(tmp_path):
    """On the bridge, `ln_final` is the final norm's output (its hook_out: what the unembedding
    reads, after the weight) and `ln_final.normalized` its hook_normalized (before the weight);
    `ln_final` on the bridge meant hook_normalized before, so a store of it records the meaning."""
    from types import SimpleNamespace

    from hookscope.sources.identity import point_meanings

    path = save(case="llama", directory=tmp_path / "llama")
    bridge = boot(path)
    ids = torch.randint(1, family_models.VOCAB - 50, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, cache = bridge.run_with_cache(ids)
    got = hs.collect(bridge, ids, ["ln_final", "ln_final.normalized", "ln_final.hook_normalized"])
    assert torch.equal(got["ln_final"], cache["ln_final.hook_out"])
    assert torch.equal(got["ln_final.normalized"], cache["ln_final.hook_normalized"])
    assert torch.equal(got["ln_final.hook_normalized"], cache["ln_final.hook_normalized"])
    assert not torch.allclose(got["ln_final"], got["ln_final.normalized"])  # the weight is not 1
    record = point_meanings(SimpleNamespace(model=bridge), ["ln_final", "ln_final.normalized", "embed"])
    assert list(record["point_meanings"]) == ["ln_final"]
    before = record["point_meanings"]["ln_final"]["before"]
    assert "before the norm's weight (now ln_final.normalized)" in before
