"""TransformerLens as the reference for what names mean.

1. On a HookedTransformer, hookscope reads TL's own HookPoints: captures equal `run_with_cache`
   to the last bit, under canonical names and `hook_` spellings alike.
2. Across implementations: the tiny Hugging Face GPT-2 / Llama / GPT-NeoX weights loaded into a
   HookedTransformer give, at every shared canonical point, what hookscope reads from the Hugging
   Face model (float32 tolerance: the two compute attention and LayerNorm differently).
"""

from __future__ import annotations

import pytest
import torch
from gate import need
from helpers import tiny_hooked_transformer
from torch import nn

import hookscope as hs
from hookscope.arch import arch_of
from hookscope.hooks import hook_count
from hookscope.names import canonical

# The TransformerLens 3 suite (HookedTransformer); tests/families/test_tl_bridge.py is the 4.x one. With
# HOOKSCOPE_REQUIRE=tl3 (scripts/test-all, main environment) a missing 3.x fails, never skips.
need("tl3")

from transformer_lens import HookedTransformer, HookedTransformerConfig  # noqa: E402
from transformer_lens.pretrained.weight_conversions import (  # noqa: E402
    convert_gpt2_weights,
    convert_llama_weights,
    convert_neox_weights,
)

# attn.in cannot be on together with split q/k/v inputs, so two models switch every hook on
OPTIONAL_HOOKS = [
    {"use_attn_result": True, "use_split_qkv_input": True, "use_hook_mlp_in": True},
    {"use_attn_in": True},
]


def hooked_transformer(**flags) -> HookedTransformer:
    return tiny_hooked_transformer(n_layers=3, d_model=64, **flags)


@pytest.fixture(scope="module")
def tl() -> HookedTransformer:
    return hooked_transformer()


@pytest.fixture(scope="module")
def toks() -> torch.Tensor:
    return torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("flags", OPTIONAL_HOOKS)
def test_every_point_equals_run_with_cache(flags, toks):
    model = hooked_transformer(**flags)
    logits, cache = model.run_with_cache(toks)
    want = {canonical(k): v for k, v in cache.items()} | {"logits": logits}
    # ln_final, the final norm's output, has no HookPoint: it is what the unembedding reads
    handle = model.unembed.register_forward_pre_hook(lambda _, args: want.__setitem__("ln_final", args[0]))
    with torch.no_grad():
        model(toks)
    handle.remove()
    arch = arch_of(model)
    ran = [n for n in arch.names if n in want]
    assert set(ran) == set(want)  # every HookPoint that fired is a point
    got = hs.collect(model, toks, ran)
    for name in ran:
        assert torch.equal(got[name], want[name]), name
    # the same, asked for in TransformerLens spelling
    got = hs.collect(model, toks, list(cache.keys()))
    for tl_name, value in cache.items():
        assert torch.equal(got[canonical(tl_name)], value), tl_name
    # a HookPoint this configuration switches off never runs: an error, not a silent gap
    switched_off = [n for n in arch.names if n not in want]
    assert switched_off
    for name in switched_off:
        with pytest.raises(hs.PointNotReachedError, match=name):
            hs.collect(model, toks, name)
    assert hook_count(model) == 0


def test_selections_match_cache_slices(tl, toks):
    _, cache = tl.run_with_cache(toks)
    got = hs.collect(
        tl, toks, ["blocks.1.attn.hook_z", "blocks.1.attn.hook_q"], heads=[3, 1], positions=slice(2, 5)
    )
    assert torch.equal(got["blocks.1.attn.z"], cache["blocks.1.attn.hook_z"][:, 2:5][:, :, [3, 1]])
    assert torch.equal(got["blocks.1.attn.q"], cache["blocks.1.attn.hook_q"][:, 2:5][:, :, [3, 1]])
    # attention patterns are [batch, head, query, key]: positions pick queries
    got = hs.collect(tl, toks, "blocks.2.attn.hook_pattern", heads=2, positions="last")[
        "blocks.2.attn.pattern"
    ]
    assert torch.equal(got, cache["blocks.2.attn.hook_pattern"][:, [2], -1])
    got = hs.collect(tl, toks, "blocks.0.hook_resid_post", positions=torch.tensor([4, 8]))[
        "blocks.0.resid_post"
    ]
    assert torch.equal(got, cache["blocks.0.hook_resid_post"][[0, 1], [4, 8]])


def test_early_stop_on_a_hooked_transformer(tl, toks):
    counts = {i: 0 for i in range(3)} | {"unembed": 0}
    handles = [
        tl.blocks[i].register_forward_pre_hook(lambda m, a, i=i: counts.__setitem__(i, counts[i] + 1))
        for i in range(3)
    ]
    handles.append(
        tl.unembed.register_forward_pre_hook(
            lambda m, a: counts.__setitem__("unembed", counts["unembed"] + 1)
        )
    )
    try:
        got = hs.collect(tl, toks, "blocks.1.hook_resid_post")
    finally:
        for h in handles:
            h.remove()
    assert counts == {0: 1, 1: 1, 2: 0, "unembed": 0}
    _, cache = tl.run_with_cache(toks, names_filter="blocks.1.hook_resid_post")
    assert torch.equal(got["blocks.1.resid_post"], cache["blocks.1.hook_resid_post"])


def test_edits_equal_run_with_hooks(tl, toks):
    def zero_head(z, hook):
        z = z.clone()
        z[:, :, 1] = 0
        return z

    want = tl.run_with_hooks(toks, fwd_hooks=[("blocks.1.attn.hook_z", zero_head)])
    with torch.no_grad(), hs.edit(tl, hs.ablate("blocks.1.attn.hook_z", heads=[1])):
        got = tl(toks)
    assert torch.equal(got, want)
    assert not torch.equal(got, tl(toks))
    assert hook_count(tl) == 0


def test_results_are_keyed_by_the_name_asked_for(tl, toks):
    _, cache = tl.run_with_cache(toks)
    for name in ("blocks.0.hook_resid_post", "blocks.1.attn.hook_z"):
        assert torch.equal(hs.collect(tl, toks, name)[name], cache[name])
    with hs.capture(tl, "blocks.0.hook_resid_post") as cap:
        tl(toks)
    assert list(cap) == ["blocks.0.hook_resid_post"]


def test_mean_ablation_of_a_pattern_averages_positions(tl, toks):
    def mean_over_queries(pattern, hook):  # [batch, head, query, key]: positions are dim 2
        return pattern.mean(dim=(0, 2), keepdim=True).expand_as(pattern)

    want = tl.run_with_hooks(toks, fwd_hooks=[("blocks.0.attn.hook_pattern", mean_over_queries)])
    with torch.no_grad(), hs.edit(tl, hs.ablate("blocks.0.attn.pattern", how="mean")):
        got = tl(toks)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert hook_count(tl) == 0


def test_aliases_of_a_hooked_transformer_name_one_hook_point(tl):
    """Every HookPoint is one point, and every hook_dict spelling reaches that very HookPoint."""
    arch = arch_of(tl)
    for tl_name, hook_point in tl.hook_dict.items():
        assert arch.module(tl, arch.spec(tl_name)) is hook_point, tl_name
    modules = [arch.module(tl, s) for s in arch.specs.values() if s.name != "logits"]
    assert len({id(m) for m in modules}) == len(modules)


# --- the same weights in both implementations -----------------------------------------------


def tl_config(hf: nn.Module) -> HookedTransformerConfig:
    """A HookedTransformerConfig matching a Hugging Face config, written out by hand."""
    c = hf.config
    if c.model_type == "gpt2":
        return HookedTransformerConfig(
            n_layers=c.n_layer,
            d_model=c.n_embd,
            n_heads=c.n_head,
            d_head=c.n_embd // c.n_head,
            d_mlp=4 * c.n_embd,
            d_vocab=c.vocab_size,
            n_ctx=c.n_positions,
            act_fn="gelu_new",
            normalization_type="LN",
            positional_embedding_type="standard",
            eps=c.layer_norm_epsilon,
            original_architecture="GPT2LMHeadModel",
        )
    d_head = c.hidden_size // c.num_attention_heads
    common = {
        "n_layers": c.num_hidden_layers,
        "d_model": c.hidden_size,
        "n_heads": c.num_attention_heads,
        "d_head": d_head,
        "d_mlp": c.intermediate_size,
        "d_vocab": c.vocab_size,
        "n_ctx": c.max_position_embeddings,
        "positional_embedding_type": "rotary",
        "rotary_base": c.rope_parameters["rope_theta"],
    }
    if c.model_type == "llama":
        return HookedTransformerConfig(
            **common,
            act_fn="silu",
            normalization_type="RMS",
            eps=c.rms_norm_eps,
            rotary_dim=d_head,
            gated_mlp=True,
            n_key_value_heads=c.num_key_value_heads,
            final_rms=True,
            original_architecture="LlamaForCausalLM",
        )
    return HookedTransformerConfig(
        **common,
        act_fn=c.hidden_act,
        normalization_type="LN",
        eps=c.layer_norm_eps,
        rotary_dim=int(d_head * c.rope_parameters["partial_rotary_factor"]),
        parallel_attn_mlp=c.use_parallel_residual,
        original_architecture="GPTNeoXForCausalLM",
    )


CONVERT = {"gpt2": convert_gpt2_weights, "llama": convert_llama_weights, "gpt_neox": convert_neox_weights}
SHARED = ["embed", "pos_embed", "ln_final.scale", "ln_final.normalized", "logits"] + [
    f"blocks.{L}.{s}"
    for L in range(3)
    for s in (
        "resid_pre",
        "attn.q",
        "attn.k",
        "attn.v",
        "attn.pattern",
        "attn.z",
        "attn.out",
        "resid_mid",
        "mlp.pre",
        "mlp.pre_linear",
        "mlp.post",
        "mlp.out",
        "resid_post",
    )
]


def same_weights(hf: nn.Module) -> HookedTransformer:
    """A HookedTransformer holding the Hugging Face model's weights (TransformerLens's conversion)."""
    cfg = tl_config(hf)
    tl = HookedTransformer(cfg).eval()
    missing, unexpected = tl.load_state_dict(CONVERT[hf.config.model_type](hf, cfg), strict=False)
    assert not unexpected
    # only buffers (masks, rotary tables) and GPT-2's absent unembedding bias (zeros) stay as built
    assert {m.rsplit(".", 1)[-1] for m in missing} <= {"mask", "IGNORE", "rotary_sin", "rotary_cos", "b_U"}
    return tl


@pytest.mark.parametrize("key", ["gpt2", "llama", "neox_parallel", "neox_sequential"])
def test_same_weights_same_points_as_transformer_lens(tiny, make_ids, key):
    hf = tiny[key].model
    tl = same_weights(hf)
    ids = make_ids(hf)
    logits, cache = tl.run_with_cache(ids)
    want = {canonical(k): v for k, v in cache.items()} | {"logits": logits}
    names = [n for n in SHARED if n in want and n in arch_of(hf).specs]
    # what each family lacks, TransformerLens lacks too (a parallel residual has no resid_mid)
    assert set(SHARED) & set(arch_of(hf).specs) == set(names)
    got = hs.collect(hf, ids, names)
    for name in names:
        ours, theirs = got[name], want[name]
        if name == "pos_embed":  # Hugging Face embeds positions once, broadcast over the batch
            assert ours.shape == (1, *theirs.shape[1:])
            ours = ours.expand_as(theirs)
        assert ours.shape == theirs.shape, name
        torch.testing.assert_close(
            ours, theirs, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )


@pytest.mark.parametrize("key", ["gpt2", "llama", "neox_sequential"])
@torch.no_grad()
def test_edits_at_resid_mid_equal_transformer_lens(tiny, make_ids, key):
    """TransformerLens's hook_resid_mid is the stream both the MLP and the skip connection read:
    a steer, a zero ablation and a patch there give the logits TransformerLens gives."""
    hf = tiny[key].model
    tl = same_weights(hf)
    ids = make_ids(hf)
    g = torch.Generator().manual_seed(4)
    v = torch.randn(tl.cfg.d_model, generator=g)
    target = torch.randn(*ids.shape, tl.cfg.d_model, generator=g)
    edits = [
        (hs.steer("blocks.1.resid_mid", v, scale=3.0), lambda mid, hook: mid + 3.0 * v),
        (hs.ablate("blocks.1.resid_mid"), lambda mid, hook: torch.zeros_like(mid)),
        (hs.patch("blocks.1.resid_mid", target), lambda mid, hook: target),
    ]
    for edit, tl_hook in edits:
        want = tl.run_with_hooks(ids, fwd_hooks=[("blocks.1.hook_resid_mid", tl_hook)])
        with hs.edit(hf, edit):
            got = hf(ids).logits
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m, e=edit: f"{e}: {m}")

    # attn.out's hooks run before resid_mid's, whichever is attached first: a steer of attn.out
    # given after a patch of resid_mid is overwritten by it, and a capture of attn.out under a
    # steer of resid_mid reads attention's own output
    steer_attn = [("blocks.1.hook_attn_out", lambda out, hook: out + v)]
    want = tl.run_with_hooks(ids, fwd_hooks=[*steer_attn, ("blocks.1.hook_resid_mid", edits[2][1])])
    with hs.edit(hf, hs.patch("blocks.1.resid_mid", target), hs.steer("blocks.1.attn.out", v)):
        torch.testing.assert_close(hf(ids).logits, want, atol=1e-4, rtol=1e-4)
    with tl.hooks(fwd_hooks=[("blocks.1.hook_resid_mid", edits[0][1])]):
        _, cache = tl.run_with_cache(ids, names_filter=["blocks.1.hook_attn_out", "blocks.1.hook_resid_mid"])
    with hs.edit(hf, edits[0][0]):
        got = hs.collect(hf, ids, ["blocks.1.attn.out", "blocks.1.resid_mid"])
    for name in got:
        torch.testing.assert_close(
            got[name],
            cache[name.replace(".attn.out", ".hook_attn_out").replace(".resid_mid", ".hook_resid_mid")],
            atol=1e-4,
            rtol=1e-4,
        )


def gemma2_config(c) -> HookedTransformerConfig:
    """TransformerLens's own Gemma 2 config (loading_from_pretrained's google/gemma-2-2b entry), with
    the tiny model's sizes and settings written in."""
    return HookedTransformerConfig(
        d_model=c.hidden_size,
        d_head=c.head_dim,
        n_heads=c.num_attention_heads,
        d_mlp=c.intermediate_size,
        n_layers=c.num_hidden_layers,
        n_ctx=c.max_position_embeddings,
        eps=c.rms_norm_eps,
        d_vocab=c.vocab_size,
        act_fn=c.hidden_activation,
        normalization_type="RMS",
        rotary_base=c.rope_parameters["rope_theta"],
        rotary_dim=c.head_dim,
        positional_embedding_type="rotary",
        use_attn_scale=True,
        attn_scale=c.query_pre_attn_scalar**0.5,
        n_key_value_heads=c.num_key_value_heads,
        window_size=c.sliding_window,
        use_local_attn=True,
        attn_types=["local" if t == "sliding_attention" else "global" for t in c.layer_types],
        attn_scores_soft_cap=c.attn_logit_softcapping or -1.0,
        output_logits_soft_cap=c.final_logit_softcapping or -1.0,
        gated_mlp=True,
        final_rms=True,
        use_normalization_before_and_after=True,
        original_architecture="Gemma2ForCausalLM",
    )


def gemma3_config(c) -> HookedTransformerConfig:
    """TransformerLens's own Gemma 3 config (its google/gemma-3-1b entry), with the tiny model's
    sizes and settings written in."""
    rope = c.rope_parameters
    return HookedTransformerConfig(
        d_model=c.hidden_size,
        d_head=c.head_dim,
        n_heads=c.num_attention_heads,
        d_mlp=c.intermediate_size,
        n_layers=c.num_hidden_layers,
        n_ctx=c.max_position_embeddings,
        eps=c.rms_norm_eps,
        d_vocab=c.vocab_size,
        act_fn=c.hidden_activation,
        normalization_type="RMS",
        rotary_base=rope["full_attention"]["rope_theta"],
        rotary_base_local=rope["sliding_attention"]["rope_theta"],
        rotary_dim=c.head_dim,
        positional_embedding_type="rotary",
        use_attn_scale=True,
        attn_scale=c.query_pre_attn_scalar**0.5,
        n_key_value_heads=c.num_key_value_heads,
        window_size=c.sliding_window,
        use_local_attn=True,
        attn_types=["local" if t == "sliding_attention" else "global" for t in c.layer_types],
        gated_mlp=True,
        final_rms=True,
        use_normalization_before_and_after=True,
        use_qk_norm=True,
        original_architecture="Gemma3ForCausalLM",
    )


def olmo2_config(c) -> HookedTransformerConfig:
    """TransformerLens's own OLMo 2 config (its allenai/OLMo-2-0425-1B entry), with the tiny model's
    sizes written in (multi-head attention: TransformerLens converts OLMo 2's k / v as full heads)."""
    return HookedTransformerConfig(
        d_model=c.hidden_size,
        d_head=c.head_dim,
        n_heads=c.num_attention_heads,
        d_mlp=c.intermediate_size,
        n_layers=c.num_hidden_layers,
        n_ctx=c.max_position_embeddings,
        eps=c.rms_norm_eps,
        d_vocab=c.vocab_size,
        act_fn=c.hidden_act,
        normalization_type="RMS",
        rotary_base=c.rope_parameters["rope_theta"],
        rotary_dim=c.head_dim,
        positional_embedding_type="rotary",
        gated_mlp=True,
        final_rms=True,
        original_architecture="Olmo2ForCausalLM",
    )


# post-normed family -> (its HookedTransformer config, TransformerLens's weight conversion, settings
# over family_models' case)
POST_NORMED = {
    "gemma2": (gemma2_config, "convert_gemma_weights", {}),
    "gemma3_text": (gemma3_config, "convert_gemma_weights", {}),
    "olmo2": (olmo2_config, "convert_olmo2_weights", {"num_key_value_heads": 4}),
}


@pytest.mark.parametrize("case", list(POST_NORMED))
def test_post_normed_names_mean_what_hooked_transformer_means(case):
    """Gemma 2 / 3 and OLMo 2 normalise each sublayer's output before the residual add:
    HookedTransformer's hook_attn_out / hook_mlp_out are after that norm, and so are hookscope's
    attn.out / mlp.out. Every name both have equals HookedTransformer on the same weights, the final
    norm's before its weight (ln_final.hook_normalized: ln_final.normalized) included. (OLMo 2 has
    no ln1 / ln2 before its sublayers: TransformerLens's ln1 / ln2 there are its post-norms.)"""
    import family_models
    from transformer_lens.pretrained import weight_conversions

    make_config, convert, settings = POST_NORMED[case]
    hf = family_models.build(case, **settings).float()
    cfg = make_config(hf.config)
    tl = HookedTransformer(cfg).eval()
    weights = getattr(weight_conversions, convert)(hf, cfg)
    missing, unexpected = tl.load_state_dict(weights, strict=False)
    assert not unexpected
    assert {m.rsplit(".", 1)[-1] for m in missing} <= {"mask", "IGNORE", "rotary_sin", "rotary_cos"}
    ids = family_models.inputs(case)["input_ids"]
    logits, cache = tl.run_with_cache(ids)
    want = {canonical(k): v for k, v in cache.items()} | {"logits": logits}
    names = [n for n in arch_of(hf).names if n in want]
    for must in (
        "blocks.1.attn.out",
        "blocks.1.mlp.out",
        "blocks.1.resid_mid",
        "ln_final.normalized",
        "ln_final.scale",
        "logits",
    ):
        assert must in names
    if case != "olmo2":
        assert "blocks.1.ln2.normalized" in names
    got = hs.collect(hf, ids, names)
    for name in names:
        torch.testing.assert_close(
            got[name], want[name], atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}"
        )
