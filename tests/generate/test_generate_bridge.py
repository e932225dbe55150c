"""hs.generate on a TransformerLens 4 `TransformerBridge` (its own generate, KV cache and
attention mask), against references independent of hookscope: the bridge's own `generate`
(tokens), its `run_with_cache` over each row's final sequence (captures), and its own
`model.hooks(fwd_hooks=...)` (steering).

The bridge's generate calls the bridge once per step, like a Hugging Face model's, so prompt and
generated positions are captured in its forward passes (the last token in one more full pass).
Tolerance: float32, atol 1e-5 / rtol 1e-4 (KV-cache steps against one full pass: rounding only).

Runs in the `tl4` test environment (scripts/test-all); elsewhere it skips, saying why. With
HOOKSCOPE_REQUIRE=tl4 a missing TransformerLens 4 is a failure, never a silent skip.
"""

from __future__ import annotations

import pytest
import torch
from gate import need

import hookscope as hs
from hookscope.hooks import hook_count

need("tl4")

from transformer_lens.model_bridge import TransformerBridge  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

ATOL, RTOL = 1e-5, 1e-4
OPTS = dict(max_new_tokens=5, do_sample=False, stop_at_eos=False)
# our point -> the bridge's own hook name, for run_with_cache
POINTS = {
    "embed": "hook_embed",
    "blocks.0.resid_post": "blocks.0.hook_resid_post",
    "blocks.1.attn.z": "blocks.1.attn.hook_z",
    "blocks.1.mlp.out": "blocks.1.hook_mlp_out",
}


@pytest.fixture(scope="module")
def bridges(tiny_dirs) -> dict[str, TransformerBridge]:
    out = {}
    for key in ("gpt2", "llama"):
        path = str(tiny_dirs[key])
        out[key] = TransformerBridge.boot_transformers(
            path,
            hf_model=AutoModelForCausalLM.from_pretrained(path),
            tokenizer=AutoTokenizer.from_pretrained(path),
            device="cpu",
        ).eval()
    return out


def padded_batch():
    """Two prompts of different lengths, left-padded (pad id 1, mask 0)."""
    return {
        "input_ids": torch.tensor([[1, 1, 7, 42, 99], [5, 17, 300, 8, 61]]),
        "attention_mask": torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]),
    }


def hooks_on(bridge) -> int:
    """Torch hooks on the bridge's HookPoints and its root, where hookscope attaches."""
    modules = [bridge, *{id(hp): hp for hp in bridge.hook_dict.values()}.values()]
    return sum(hook_count(m) - sum(hook_count(c) for c in m.children()) for m in modules)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_padded_batch_captures_equal_run_with_cache_row_by_row(bridges, family):
    bridge = bridges[family]
    inputs = padded_batch()
    gen = hs.generate(bridge, inputs, list(POINTS), **OPTS)
    expected = bridge.generate(
        inputs["input_ids"], attention_mask=inputs["attention_mask"], verbose=False, **OPTS
    )
    assert torch.equal(gen.sequences, expected)
    assert gen.sequences.shape == (2, 10)
    assert gen.mask.tolist() == [[False, False] + [True] * 8, [True] * 10]
    cfg = bridge.cfg
    assert gen["blocks.1.attn.z"].shape == (2, 10, cfg.n_heads, cfg.d_head)
    for b in range(2):
        real = inputs["attention_mask"][b].bool()
        one = hs.generate(bridge, inputs["input_ids"][b : b + 1, real], list(POINTS), **OPTS)
        # the padded row generates what the row alone does ...
        assert torch.equal(gen.sequences[b, gen.mask[b]], one.sequences[0])
        _, cache = bridge.run_with_cache(one.sequences)
        for point, name in POINTS.items():
            # ... and at every real position computes what one forward over its final tokens does
            torch.testing.assert_close(one[point][0], cache[name][0], atol=ATOL, rtol=RTOL)
            torch.testing.assert_close(gen[point][b][gen.mask[b]], cache[name][0], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("edit_on", ["both", "generated"])
def test_steer_gives_the_tokens_of_the_bridge_own_hooks(bridges, edit_on):
    bridge = bridges["gpt2"]
    ids = torch.tensor([[5, 17, 300, 8, 61], [9, 8, 7, 6, 5]])
    vector = torch.randn(bridge.cfg.d_model, generator=torch.Generator().manual_seed(2)) * 8

    def add(act, hook):
        # the prompt pass covers all 5 prompt positions; each later pass one new token
        return act + vector if edit_on == "both" or act.shape[1] == 1 else act

    with bridge.hooks(fwd_hooks=[("blocks.0.hook_resid_post", add)]):
        expected = bridge.generate(ids, verbose=False, **OPTS)
    assert not torch.equal(expected, bridge.generate(ids, verbose=False, **OPTS))  # the vector matters
    before = hooks_on(bridge)
    gen = hs.generate(
        bridge,
        ids,
        "blocks.1.resid_pre",
        edits=[hs.steer("blocks.0.resid_post", vector)],
        edit_on=edit_on,
        **OPTS,
    )
    assert torch.equal(gen.sequences, expected)
    assert hooks_on(bridge) == before
    # what the next block reads is the steered stream: a teacher-forced pass with the same hook
    with bridge.hooks(fwd_hooks=[("blocks.0.hook_resid_post", lambda act, hook: act + vector)]):
        _, cache = bridge.run_with_cache(gen.sequences)
    new = slice(5, None) if edit_on == "generated" else slice(0, None)
    torch.testing.assert_close(
        gen["blocks.1.resid_pre"][:, new], cache["blocks.1.hook_resid_pre"][:, new], atol=ATOL, rtol=RTOL
    )


def test_no_hook_remains_after_generation_raises(bridges):
    bridge = bridges["gpt2"]
    before = hooks_on(bridge)
    with pytest.raises(hs.SelectionError, match="source covers"):
        hs.generate(
            bridge,
            padded_batch(),
            "blocks.0.resid_post",
            edits=[hs.patch("blocks.0.resid_post", torch.zeros(2, 3, bridge.cfg.d_model))],
            **OPTS,
        )
    assert hooks_on(bridge) == before
    gen = hs.generate(bridge, padded_batch(), "blocks.0.resid_post", **OPTS)  # and it still works
    assert gen["blocks.0.resid_post"].shape == (2, 10, bridge.cfg.d_model)


def test_a_bridge_whose_cache_stays_empty_is_refused(bridges, monkeypatch):
    """TransformerLens 4.3's attention under transformers >= 5.24 never stores into the KV cache, so the
    bridge's own generate computes each new token without its context. Simulated here on the pinned
    transformers (the cache's `update` stores nothing): hs.generate refuses at the first cached step,
    and `use_past_kv_cache=False`, which the error names, captures what run_with_cache computes."""
    from transformers import DynamicCache

    bridge = bridges["gpt2"]
    ids = torch.tensor([[5, 17, 300, 8, 61], [9, 8, 7, 6, 5]])
    before = hooks_on(bridge)
    monkeypatch.setattr(DynamicCache, "update", lambda self, key, value, *args, **kwargs: (key, value))
    with pytest.raises(hs.HookscopeError, match="empty KV cache.*use_past_kv_cache=False"):
        hs.generate(bridge, ids, list(POINTS), **OPTS)
    assert hooks_on(bridge) == before
    gen = hs.generate(bridge, ids, list(POINTS), use_past_kv_cache=False, **OPTS)
    assert torch.equal(gen.sequences, bridge.generate(ids, verbose=False, use_past_kv_cache=False, **OPTS))
    _, cache = bridge.run_with_cache(gen.sequences)
    for point, name in POINTS.items():
        torch.testing.assert_close(gen[point], cache[name], atol=ATOL, rtol=RTOL)


def test_the_result_reads_a_bridge_alias_as_collect_does(bridges):
    """`blocks.0.hook_out` is the bridge's own spelling of blocks.0.resid_post, which `names.canonical`
    cannot fold (it reads `blocks.0.out`): `hs.collect`'s result reads it, and a Generation reads it
    the same way, with the values of the bridge's own `run_with_cache` under that name."""
    bridge = bridges["gpt2"]
    ids = torch.tensor([[5, 17, 300, 8, 61], [9, 8, 7, 6, 5]])
    collected = hs.collect(bridge, ids, "blocks.0.resid_post")
    assert "blocks.0.hook_out" in collected  # the alias works in collect ...
    gen = hs.generate(bridge, ids, "blocks.0.resid_post", **OPTS)
    assert "blocks.0.hook_out" in gen  # ... and on a Generation
    _, cache = bridge.run_with_cache(gen.sequences)
    torch.testing.assert_close(gen["blocks.0.hook_out"], cache["blocks.0.hook_out"], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(
        gen["blocks.0.hook_out"][:, :5], collected["blocks.0.hook_out"], atol=ATOL, rtol=RTOL
    )
    # asked by the alias, the key is the name asked for, as collect keys it
    by_alias = hs.generate(bridge, ids, "blocks.0.hook_out", **OPTS)
    assert list(by_alias) == list(hs.collect(bridge, ids, "blocks.0.hook_out")) == ["blocks.0.hook_out"]
    assert torch.equal(by_alias["blocks.0.resid_post"], gen["blocks.0.resid_post"])
