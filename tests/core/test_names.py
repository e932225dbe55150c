"""Point names: TransformerLens aliases fold to one canonical spelling, raw module paths parse,
patterns expand in the model's order, and a typo gets the closest real names."""

from __future__ import annotations

import pytest

import hookscope as hs
from hookscope.names import (
    ModulePath,
    canonical,
    expand,
    find_key,
    is_pattern,
    layer_of,
    parse_module_path,
    suggest,
)

KNOWN = (
    ["embed"]
    + [
        f"blocks.{L}.{s}"
        for L in range(12)
        for s in ("resid_pre", "attn.z", "attn.out", "mlp.out", "resid_post")
    ]
    + ["ln_final", "logits"]
)


@pytest.mark.parametrize(
    "alias, name",
    [
        ("blocks.6.hook_resid_post", "blocks.6.resid_post"),
        ("blocks.6.hook_resid_pre", "blocks.6.resid_pre"),
        ("blocks.6.hook_attn_out", "blocks.6.attn.out"),
        ("blocks.6.hook_mlp_out", "blocks.6.mlp.out"),
        ("blocks.6.attn.hook_z", "blocks.6.attn.z"),
        ("blocks.6.attn.hook_pattern", "blocks.6.attn.pattern"),
        ("blocks.6.mlp.hook_post", "blocks.6.mlp.post"),
        ("blocks.6.hook_q_input", "blocks.6.attn.q_input"),
        ("hook_embed", "embed"),
        ("hook_pos_embed", "pos_embed"),
        # TransformerLens's final norm before its weight, and the bridge's after it
        ("ln_final.hook_normalized", "ln_final.normalized"),
        ("ln_final.hook_scale", "ln_final.scale"),
        ("ln_final.hook_out", "ln_final"),
        ("  blocks.0.resid_post ", "blocks.0.resid_post"),
        ("blocks.0.resid_post", "blocks.0.resid_post"),
        ("module:model.layers.6.mlp.down_proj", "module:model.layers.6.mlp.down_proj:output"),
        ("module:model.layers.6.mlp.down_proj:input", "module:model.layers.6.mlp.down_proj:input"),
    ],
)
def test_canonical_spelling(alias, name):
    assert canonical(alias) == name
    assert canonical(name) == name  # idempotent


def test_parse_module_path():
    assert parse_module_path("module:a.b.0:input") == ModulePath("a.b.0", "input")
    assert parse_module_path("module:a.b") == ModulePath("a.b", "output")
    for bad in ("module::input", "module:a.b:sideways"):
        with pytest.raises(hs.UnknownPointError, match="module:<dotted.module.path>"):
            parse_module_path(bad)


def test_layer_of_and_is_pattern():
    assert layer_of("blocks.11.attn.z") == 11
    assert layer_of("embed") is None and layer_of("module:blocks.3:output") is None
    assert (
        is_pattern("blocks.*.resid_post") and is_pattern("blocks.1?.attn.z") and is_pattern("blocks.[12].x")
    )
    assert not is_pattern("blocks.1.resid_post")


def test_expand_orders_patterns_by_the_model_and_names_by_the_caller():
    assert expand("blocks.*.resid_post", KNOWN) == [f"blocks.{L}.resid_post" for L in range(12)]
    assert expand(["logits", "blocks.3.hook_resid_pre"], KNOWN) == ["logits", "blocks.3.resid_pre"]
    # comma-separated strings, duplicates dropped (first occurrence kept)
    assert expand("blocks.2.attn.z, blocks.1?.mlp.out,blocks.2.attn.hook_z", KNOWN) == [
        "blocks.2.attn.z",
        "blocks.10.mlp.out",
        "blocks.11.mlp.out",
    ]
    assert expand(["blocks.1.attn.z", "blocks.1.attn.hook_z"], KNOWN) == ["blocks.1.attn.z"]
    assert expand("module:x.y:input", KNOWN) == ["module:x.y:input"]


def test_unknown_names_list_the_closest():
    with pytest.raises(hs.UnknownPointError) as err:
        expand("blocks.1.resid_pots", KNOWN)
    message = str(err.value)
    assert message.startswith("unknown point 'blocks.1.resid_pots'; closest: blocks.1.resid_post")
    assert "blocks 0-11" in message and "hookscope points" in message
    assert suggest("blocks.3.atn.out", KNOWN)[0] == "blocks.3.attn.out"
    far = suggest("blocks.99.resid_post", KNOWN)
    assert far and all(n.endswith(".resid_post") for n in far)
    with pytest.raises(hs.UnknownPointError, match="matches no point"):
        expand("blocks.*.nothing", KNOWN)
    assert suggest("zzzz", KNOWN) == []


def test_find_key_answers_any_spelling_of_a_kept_point():
    keys = ["blocks.0.hook_resid_post", "blocks.2.attn.hook_z"]
    assert find_key(keys, "blocks.0.resid_post") == "blocks.0.hook_resid_post"
    assert find_key(keys, "blocks.2.attn.z") == "blocks.2.attn.hook_z"
    assert find_key(keys, "blocks.2.attn.hook_z") == "blocks.2.attn.hook_z"  # as written
    assert find_key(keys, "blocks.1.resid_post") is None
    # both spellings kept: the one asked for wins over the first in order
    assert (
        find_key(["blocks.0.resid_post", "blocks.0.hook_resid_post"], "blocks.0.hook_resid_post")
        == "blocks.0.hook_resid_post"
    )


def test_find_key_takes_a_model_tables_own_spellings():
    """A bridge's spelling (`blocks.0.ln1.hook_normalized`, say) that `canonical` cannot fold is
    found through the lookup given, and a name that lookup does not know finds nothing."""
    table = {"blocks.0.ln1.hook_normalized": "blocks.0.ln1", "blocks.0.ln1": "blocks.0.ln1"}
    assert find_key(["blocks.0.ln1"], "blocks.0.ln1.hook_normalized", table.get) == "blocks.0.ln1"
    assert find_key(["blocks.0.ln1"], "blocks.0.ln1.hook_normalized") is None  # canonical alone
    assert find_key(["blocks.0.ln1"], "blocks.9.ln1", table.get) is None
