"""Capture: every canonical point of every family equals a plain torch-hook reference written here
from the Hugging Face module tree (head splits included, written independently of the arch
tables); early stop provably skips later layers; selections and copies keep the right values."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import plain_hooks
from torch import Tensor, nn

import hookscope as hs
from hookscope.arch import arch_of
from hookscope.hooks import hook_count

OUT, IN = "output", "input"
Entry = tuple[nn.Module, str, Callable[[Any], Tensor]]


def same(x: Tensor) -> Tensor:
    return x


def first(output: tuple) -> Tensor:
    return output[0]


def second(output: tuple) -> Tensor:  # attention weights of an HF attention module
    return output[1]


def block_out(output: Tensor | tuple) -> Tensor:
    """A block's hidden states: the output itself in transformers >= 5.x's later releases, element 0
    of the (hidden, ...) tuple GPT-2 and GPT-NeoX blocks return in 5.0 (the floor environment)."""
    return output[0] if isinstance(output, tuple) else output


def per_head(n_heads: int) -> Callable[[Tensor], Tensor]:
    return lambda x: x.view(x.shape[0], x.shape[1], n_heads, x.shape[2] // n_heads)


def norm_parts(ln: str, norm: nn.Module) -> dict[str, Entry]:
    """TransformerLens's `{ln}.scale` / `{ln}.normalized` (before weight and bias), by hand from
    the norm's input: LayerNorm centres, RMSNorm does not."""
    eps = getattr(norm, "eps", None) or norm.variance_epsilon
    centre = "RMS" not in type(norm).__name__

    def scale(x: Tensor) -> Tensor:
        x = x - x.mean(-1, keepdim=True) if centre else x
        return (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()

    def normalized(x: Tensor) -> Tensor:
        return (x - x.mean(-1, keepdim=True) if centre else x) / scale(x)

    return {f"{ln}.scale": (norm, IN, scale), f"{ln}.normalized": (norm, IN, normalized)}


# --- the reference: which HF module, which side, how to read the point from its tensor --------


def gpt2_table(model: nn.Module) -> dict[str, Entry]:
    base, cfg = model.transformer, model.config
    d, H = cfg.n_embd, cfg.n_head

    def fused(i: int) -> Callable[[Tensor], Tensor]:  # c_attn output is [q | k | v]
        return lambda o: o.split(d, dim=-1)[i].view(o.shape[0], o.shape[1], H, d // H)

    t: dict[str, Entry] = {"embed": (base.wte, OUT, same), "pos_embed": (base.wpe, OUT, same)}
    for L, blk in enumerate(base.h):
        p = f"blocks.{L}."
        t |= {
            p + "resid_pre": (blk, IN, same),
            **{p + k: e for k, e in norm_parts("ln1", blk.ln_1).items()},
            p + "attn.in": (blk.ln_1, OUT, same),
            p + "attn.q": (blk.attn.c_attn, OUT, fused(0)),
            p + "attn.k": (blk.attn.c_attn, OUT, fused(1)),
            p + "attn.v": (blk.attn.c_attn, OUT, fused(2)),
            p + "attn.pattern": (blk.attn, OUT, second),
            p + "attn.z": (blk.attn.c_proj, IN, per_head(H)),
            p + "attn.out": (blk.attn, OUT, first),
            p + "resid_mid": (blk.ln_2, IN, same),
            **{p + k: e for k, e in norm_parts("ln2", blk.ln_2).items()},
            p + "mlp.in": (blk.ln_2, OUT, same),
            p + "mlp.pre": (blk.mlp.c_fc, OUT, same),
            p + "mlp.post": (blk.mlp.act, OUT, same),
            p + "mlp.out": (blk.mlp, OUT, same),
            p + "resid_post": (blk, OUT, block_out),
        }
    return (
        t
        | norm_parts("ln_final", base.ln_f)
        | {"ln_final": (base.ln_f, OUT, same), "logits": (model.lm_head, OUT, same)}
    )


def llama_table(model: nn.Module) -> dict[str, Entry]:
    base, cfg = model.model, model.config
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    t: dict[str, Entry] = {"embed": (base.embed_tokens, OUT, same)}
    for L, blk in enumerate(base.layers):
        p, att, mlp = f"blocks.{L}.", blk.self_attn, blk.mlp
        t |= {
            p + "resid_pre": (blk, IN, same),
            **{p + k: e for k, e in norm_parts("ln1", blk.input_layernorm).items()},
            p + "attn.in": (blk.input_layernorm, OUT, same),
            p + "attn.q": (att.q_proj, OUT, per_head(H)),
            p + "attn.k": (att.k_proj, OUT, per_head(KV)),  # grouped-query: fewer k / v heads
            p + "attn.v": (att.v_proj, OUT, per_head(KV)),
            p + "attn.pattern": (att, OUT, second),
            p + "attn.z": (att.o_proj, IN, per_head(H)),
            p + "attn.out": (att, OUT, first),
            p + "resid_mid": (blk.post_attention_layernorm, IN, same),
            **{p + k: e for k, e in norm_parts("ln2", blk.post_attention_layernorm).items()},
            p + "mlp.in": (blk.post_attention_layernorm, OUT, same),
            p + "mlp.pre": (mlp.gate_proj, OUT, same),
            p + "mlp.pre_linear": (mlp.up_proj, OUT, same),
            # mlp.post = act(gate) * up: made from two hooks after the run (see reference())
            p + "mlp.act": (mlp.act_fn, OUT, same),
            p + "mlp.out": (mlp, OUT, same),
            p + "resid_post": (blk, OUT, block_out),
        }
    return (
        t
        | norm_parts("ln_final", base.norm)
        | {"ln_final": (base.norm, OUT, same), "logits": (model.lm_head, OUT, same)}
    )


def neox_table(model: nn.Module) -> dict[str, Entry]:
    base, cfg = model.gpt_neox, model.config
    H = cfg.num_attention_heads

    def interleaved(i: int) -> Callable[[Tensor], Tensor]:  # per head [q_h | k_h | v_h]
        def read(o: Tensor) -> Tensor:
            dh = o.shape[-1] // (3 * H)
            return o.view(o.shape[0], o.shape[1], H, 3 * dh)[..., i * dh : (i + 1) * dh]

        return read

    t: dict[str, Entry] = {"embed": (base.embed_in, OUT, same)}
    for L, blk in enumerate(base.layers):
        p, att = f"blocks.{L}.", blk.attention
        t |= {
            p + "resid_pre": (blk, IN, same),
            **{p + k: e for k, e in norm_parts("ln1", blk.input_layernorm).items()},
            p + "attn.in": (blk.input_layernorm, OUT, same),
            **{p + k: e for k, e in norm_parts("ln2", blk.post_attention_layernorm).items()},
            p + "mlp.in": (blk.post_attention_layernorm, OUT, same),
            p + "attn.q": (att.query_key_value, OUT, interleaved(0)),
            p + "attn.k": (att.query_key_value, OUT, interleaved(1)),
            p + "attn.v": (att.query_key_value, OUT, interleaved(2)),
            p + "attn.pattern": (att, OUT, second),
            p + "attn.z": (att.dense, IN, per_head(H)),
            p + "attn.out": (att, OUT, first),
            p + "mlp.pre": (blk.mlp.dense_h_to_4h, OUT, same),
            p + "mlp.post": (blk.mlp.act, OUT, same),
            p + "mlp.out": (blk.mlp, OUT, same),
            p + "resid_post": (blk, OUT, block_out),
        }
        if not cfg.use_parallel_residual:  # in parallel, attention and MLP both read resid_pre
            t[p + "resid_mid"] = (blk.post_attention_layernorm, IN, same)
    # the head is `embed_out` in transformers 5.0, `lm_head` later: HF's own accessor finds either
    head = model.get_output_embeddings()
    final = base.final_layer_norm
    return t | norm_parts("ln_final", final) | {"ln_final": (final, OUT, same), "logits": (head, OUT, same)}


def bert_table(model: nn.Module) -> dict[str, Entry]:
    cfg = model.config
    H = cfg.num_attention_heads
    emb = model.embeddings
    t: dict[str, Entry] = {
        "embed": (emb.word_embeddings, OUT, same),
        "pos_embed": (emb.position_embeddings, OUT, same),
    }
    for L, blk in enumerate(model.encoder.layer):
        p, att = f"blocks.{L}.", blk.attention
        t |= {
            p + "resid_pre": (blk, IN, same),
            p + "attn.in": (att.self, IN, same),  # post-LN: attention reads the stream itself
            p + "attn.q": (att.self.query, OUT, per_head(H)),
            p + "attn.k": (att.self.key, OUT, per_head(H)),
            p + "attn.v": (att.self.value, OUT, per_head(H)),
            p + "attn.pattern": (att.self, OUT, second),
            p + "attn.z": (att.self, OUT, lambda o: per_head(H)(o[0])),  # heads merged, before the projection
            p + "attn.out": (att.output.dense, OUT, same),
            p + "resid_mid": (att.output, OUT, same),  # post-LN: the normalised attention sublayer
            p + "mlp.in": (blk.intermediate.dense, IN, same),
            p + "mlp.pre": (blk.intermediate.dense, OUT, same),
            p + "mlp.post": (blk.intermediate, OUT, same),
            p + "mlp.out": (blk.output.dense, OUT, same),
            p + "resid_post": (blk.output, OUT, same),
        }
    return t


TABLES = {"gpt2": gpt2_table, "llama": llama_table, "gpt_neox": neox_table, "bert": bert_table}


def reference(
    model: nn.Module, inputs: Any, names: list[str] | None = None, **options: Any
) -> dict[str, Tensor]:
    """One forward pass with plain `register_forward_hook` / `register_forward_pre_hook` on the
    modules of the reference table; returns detached copies by canonical name. `options` are extra
    keyword arguments of the forward (e.g. `use_cache=False`)."""
    table = TABLES[model.config.model_type](model)
    derived_mlp_post = model.config.model_type == "llama"
    if names is not None:
        keep = set(names) | (
            {
                n.replace("mlp.post", s)
                for n in names
                if n.endswith("mlp.post")
                for s in ("mlp.act", "mlp.pre_linear")
            }
            if derived_mlp_post
            else set()
        )
        table = {n: e for n, e in table.items() if n in keep}
    got = plain_hooks(
        model,
        table,
        lambda: model(**inputs, **options) if isinstance(inputs, dict) else model(inputs, **options),
    )  # the table's sides are plain_hooks' "output" / "input"
    if derived_mlp_post:
        for name in [n for n in got if n.endswith("mlp.act")]:
            got[name.replace("mlp.act", "mlp.post")] = (
                got.pop(name) * got[name.replace("mlp.act", "mlp.pre_linear")]
            )
    return got


def reference_names(model: nn.Module) -> set[str]:
    names = set(TABLES[model.config.model_type](model))
    if model.config.model_type == "llama":
        names = {n.replace("mlp.act", "mlp.post") for n in names}
    return names


@pytest.fixture(params=["gpt2", "llama", "neox_parallel", "neox_sequential", "bert", "minilm"])
def subject(request, make_ids) -> tuple[nn.Module, Any]:
    """(model, inputs) for every family and the real MiniLM (with padding and an attention mask)."""
    if request.param == "minilm":
        loaded = request.getfixturevalue("minilm")
        enc = loaded.tokenizer(
            ["A man is playing a guitar.", "Hooks cost nothing."], padding=True, return_tensors="pt"
        )
        return loaded.model, dict(enc)
    model = request.getfixturevalue("tiny")[request.param].model
    return model, make_ids(model)


def test_every_point_equals_plain_hooks(subject):
    model, inputs = subject
    arch = arch_of(model)
    assert set(arch.names) == reference_names(model), "the reference must cover every canonical point"
    names = [n for n in arch.names if not n.endswith("attn.pattern")]  # patterns: eager only, below
    want = reference(model, inputs, names)
    got = hs.collect(model, inputs, names)
    assert list(got) == names
    for name in names:
        assert got[name].shape == want[name].shape, name
        assert torch.equal(got[name], want[name]), name
    assert hook_count(model) == 0


def test_attention_pattern_equals_eager_weights(subject):
    model, inputs = subject
    names = [n for n in arch_of(model).names if n.endswith("attn.pattern")]
    # A stopped pass runs a decoder with use_cache=False (it would throw the cache away), and the
    # two forwards may round differently: with the cache, keys come out of a torch.cat in another
    # memory layout (1 ulp apart on an AMD EPYC, equal on a Xeon). So each capture is compared with
    # the reference forward it makes: stopped vs no cache, stop=False vs the default forward.
    takes_use_cache = "use_cache" in inspect.signature(type(model).forward).parameters
    stopped_options = {"use_cache": False} if takes_use_cache and model.config.use_cache else {}
    kernel = model.config._attn_implementation
    assert kernel != "eager"
    model.set_attn_implementation("eager")
    try:
        want_stopped = reference(model, inputs, names, **stopped_options)
        want_full = reference(model, inputs, names)
    finally:
        model.set_attn_implementation(kernel)
    for got, want in (
        (hs.collect(model, inputs, names), want_stopped),
        (hs.collect(model, inputs, names, stop=False), want_full),
    ):
        for name in names:
            assert got[name].shape == (
                2,
                model.config.num_attention_heads,
                want[name].shape[2],
                want[name].shape[3],
            )
            assert torch.equal(got[name], want[name]), name
            assert torch.allclose(got[name].sum(-1), torch.ones(()))  # rows of a softmax
        assert model.config._attn_implementation == kernel  # the model's own kernel is back


def test_residual_stream_adds_up(tiny, make_ids):
    """What the names mean: resid_mid = resid_pre + attn.out, resid_post = resid_mid + mlp.out
    (both terms of a parallel residual at once), and each block reads the previous one's output."""
    for key in ("gpt2", "llama", "neox_sequential", "neox_parallel"):
        model = tiny[key].model
        ids = make_ids(model)
        acts = hs.collect(model, ids, "blocks.*")
        for L in range(3):
            a = {k.split(".", 2)[2]: v for k, v in acts.items() if k.startswith(f"blocks.{L}.")}
            if key == "neox_parallel":
                assert torch.equal(a["resid_post"], a["mlp.out"] + a["attn.out"] + a["resid_pre"])
            else:
                assert torch.equal(a["resid_mid"], a["attn.out"] + a["resid_pre"]), key
                assert torch.equal(a["resid_post"], a["mlp.out"] + a["resid_mid"]), key
            if L:
                assert torch.equal(a["resid_pre"], acts[f"blocks.{L - 1}.resid_post"])
    gpt2 = tiny["gpt2"].model
    acts = hs.collect(gpt2, make_ids(gpt2), ["embed", "pos_embed", "blocks.0.resid_pre"])
    assert torch.equal(acts["blocks.0.resid_pre"], acts["embed"] + acts["pos_embed"])


def test_points_lists_shapes(gpt2, ids):
    infos = hs.points(gpt2, ids)
    by_name = {p.name: p for p in infos}
    assert [p.name for p in infos] == arch_of(gpt2).names
    want = reference(gpt2, ids, [n for n in by_name if not n.endswith("attn.pattern")])
    for name, act in want.items():
        assert by_name[name].shape == tuple(act.shape), name
    assert by_name["blocks.1.attn.q"].shape == (2, 7, 4, 16)
    assert by_name["blocks.1.attn.z"].module == "transformer.h.1.attn.c_proj"
    assert by_name["blocks.1.attn.z"].io == "input"
    assert [p.shape for p in hs.points(gpt2)] == [None] * len(infos)  # no example: no forward pass
    assert hook_count(gpt2) == 0


# --- early stop --------------------------------------------------------------------------


def count_calls(modules: dict[str, nn.Module]) -> tuple[dict[str, int], list]:
    counts = dict.fromkeys(modules, 0)
    handles = []
    for key, module in modules.items():

        def bump(mod, args, key=key):
            counts[key] += 1

        handles.append(module.register_forward_pre_hook(bump))
    return counts, handles


def gpt2_parts(model: nn.Module) -> dict[str, nn.Module]:
    h = model.transformer.h
    return {
        "block0": h[0],
        "block1": h[1],
        "block2": h[2],
        "block2.ln_1": h[2].ln_1,
        "ln_f": model.transformer.ln_f,
        "lm_head": model.lm_head,
    }


def test_early_stop_skips_later_blocks(gpt2, ids):
    counts, handles = count_calls(gpt2_parts(gpt2))
    try:
        acts = hs.collect(gpt2, ids, "blocks.1.resid_post")
        assert counts == {"block0": 1, "block1": 1, "block2": 0, "block2.ln_1": 0, "ln_f": 0, "lm_head": 0}
        assert torch.equal(
            acts["blocks.1.resid_post"], reference(gpt2, ids, ["blocks.1.resid_post"])["blocks.1.resid_post"]
        )

        counts.update(dict.fromkeys(counts, 0))
        acts = hs.collect(gpt2, ids, "blocks.2.resid_pre")  # stop before block 2's body runs
        assert counts["block1"] == 1 and counts["block2.ln_1"] == 0 and counts["lm_head"] == 0
        assert torch.equal(
            acts["blocks.2.resid_pre"], reference(gpt2, ids, ["blocks.1.resid_post"])["blocks.1.resid_post"]
        )

        counts.update(dict.fromkeys(counts, 0))
        hs.collect(gpt2, ids, ["blocks.0.mlp.out", "blocks.0.attn.q"])  # the last point to *run* decides
        assert counts["block0"] == 1 and counts["block1"] == 0
    finally:
        for h in handles:
            h.remove()
    assert hook_count(gpt2) == 0


def test_capture_block_without_stop_runs_the_whole_model(gpt2, ids):
    with torch.no_grad():
        plain = gpt2(ids).logits
    counts, handles = count_calls(gpt2_parts(gpt2))
    try:
        with hs.capture(gpt2, ["blocks.0.resid_post", "logits"]) as cap:
            out = gpt2(ids)
    finally:
        for h in handles:
            h.remove()
    assert counts == dict.fromkeys(counts, 1)
    assert torch.equal(out.logits, plain)
    assert torch.equal(cap["logits"], plain)
    assert torch.equal(
        cap["blocks.0.resid_post"], reference(gpt2, ids, ["blocks.0.resid_post"])["blocks.0.resid_post"]
    )

    with hs.capture(
        gpt2, "blocks.0.resid_post", stop=False
    ) as cap:  # run() without a stop returns the output
        assert torch.equal(cap.run(ids).logits, plain)


class Branchy(nn.Module):
    """Two blocks and a module on a path the forward never takes."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.unused = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_point_that_never_runs_is_an_error():
    torch.manual_seed(0)
    model, x = Branchy().eval(), torch.randn(2, 3, 8)
    with pytest.raises(hs.PointNotReachedError, match="unused"):
        hs.collect(model, x, "module:unused:output")
    with pytest.raises(hs.PointNotReachedError, match="unused"):
        hs.collect(model, x, ["blocks.0.resid_post", "module:unused:output"])
    assert hook_count(model) == 0
    with hs.capture(model, "module:unused:output") as cap:
        model(x)
    with pytest.raises(hs.PointNotReachedError):
        cap["module:unused:output"]
    # the generic table: blocks of the longest ModuleList
    got = hs.collect(model, x, "blocks.1.resid_post")["blocks.1.resid_post"]
    assert torch.equal(got, model(x))


def test_encoder_has_no_logits(tiny, make_ids):
    bert = tiny["bert"].model
    with pytest.raises(hs.UnknownPointError):
        hs.collect(bert, make_ids(bert), "logits")


# --- selections ---------------------------------------------------------------------------


@pytest.fixture
def gpt2_ref(gpt2, ids) -> dict[str, Tensor]:
    return reference(gpt2, ids, ["blocks.1.resid_post", "blocks.1.attn.z", "blocks.1.attn.q"])


@pytest.mark.parametrize(
    "positions, index",
    [
        (3, (slice(None), 3)),
        (-2, (slice(None), -2)),
        ("last", (slice(None), -1)),
        (slice(1, 4), (slice(None), slice(1, 4))),
        ([0, 2, 6], (slice(None), [0, 2, 6])),
        (torch.tensor([2, 5]), (torch.arange(2), torch.tensor([2, 5]))),  # one position per row
    ],
)
def test_positions(gpt2, ids, gpt2_ref, positions, index):
    for name in ("blocks.1.resid_post", "blocks.1.attn.z"):
        got = hs.collect(gpt2, ids, name, positions=positions)[name]
        assert torch.equal(got, gpt2_ref[name][index]), (name, positions)


def test_int_position_drops_the_dim_and_a_list_keeps_it(gpt2, ids):
    name = "blocks.1.resid_post"
    assert hs.collect(gpt2, ids, name, positions=3)[name].shape == (2, 64)
    assert hs.collect(gpt2, ids, name, positions=[3])[name].shape == (2, 1, 64)
    assert hs.collect(gpt2, ids, name, positions=slice(3, 4))[name].shape == (2, 1, 64)


def test_heads(gpt2, ids, gpt2_ref):
    for name in ("blocks.1.attn.z", "blocks.1.attn.q"):
        got = hs.collect(gpt2, ids, name, heads=[3, 1])[name]
        assert torch.equal(got, gpt2_ref[name][:, :, [3, 1]])
    got = hs.collect(gpt2, ids, "blocks.1.attn.z", heads=2, positions="last")["blocks.1.attn.z"]
    assert torch.equal(got, gpt2_ref["blocks.1.attn.z"][:, -1, [2]])
    with pytest.raises(hs.SelectionError, match="head"):
        hs.collect(gpt2, ids, "blocks.1.resid_post", heads=[0])
    with pytest.raises(hs.SelectionError, match="out of range"):
        hs.collect(gpt2, ids, "blocks.1.attn.z", heads=[4])
    assert hook_count(gpt2) == 0


def test_check_dims_refuses_before_a_pass_in_takes_words(gpt2, ids):
    """What a capture in another process (a vLLM worker) checks before it runs: the error `take`
    raises during the pass, word for word; a selection that fits passes."""
    from hookscope.selection import Selection

    arch = arch_of(gpt2)
    for point, options in (("blocks.1.resid_post", {"heads": [0]}), ("blocks.1.resid_post", {"heads": 1})):
        with pytest.raises(hs.SelectionError) as during:
            hs.collect(gpt2, ids, point, **options)
        with pytest.raises(hs.SelectionError) as before:
            Selection.of(**options).check_dims(arch.spec(point))
        assert str(before.value) == str(during.value)
    Selection.of(heads=[0], positions=[-1]).check_dims(arch.spec("blocks.1.attn.z"))
    no_positions = type("NoPositions", (), {"pos_dim": None, "head_dim": None})()
    with pytest.raises(hs.SelectionError, match="no position dimension"):
        Selection.of(positions=0).check_dims(no_positions)


def test_token_mask_keeps_rows(gpt2, ids, gpt2_ref):
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[:, 0] = False  # drop BOS
    mask[1, 5:] = False  # and row 1's padding
    got = hs.collect(gpt2, ids, ["blocks.1.resid_post", "blocks.1.attn.z"], token_mask=mask)
    assert got["blocks.1.resid_post"].shape == (10, 64)
    assert torch.equal(got["blocks.1.resid_post"], gpt2_ref["blocks.1.resid_post"][mask])
    assert torch.equal(got["blocks.1.attn.z"], gpt2_ref["blocks.1.attn.z"][mask])
    with pytest.raises(hs.SelectionError, match="token_mask"):
        hs.collect(gpt2, ids, "blocks.1.resid_post", token_mask=mask[:, :3])
    with pytest.raises(hs.SelectionError, match="either"):
        hs.capture(gpt2, "blocks.1.resid_post", token_mask=mask, positions=0)


def test_dtype_and_device(gpt2, ids, gpt2_ref):
    name = "blocks.1.resid_post"
    got = hs.collect(gpt2, ids, name, dtype=torch.bfloat16, positions=[1, 2])[name]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, gpt2_ref[name][:, [1, 2]].to(torch.bfloat16))
    got = hs.collect(gpt2, ids, name, device="cpu")[name]
    assert got.device == torch.device("cpu") and torch.equal(got, gpt2_ref[name])


def test_capture_runs_under_inference_mode_by_default(gpt2, ids):
    name = "blocks.0.resid_post"
    assert hs.collect(gpt2, ids, name)[name].is_inference()
    assert not hs.collect(gpt2, ids, name, inference=False)[name].is_inference()


def test_accumulate_concatenates_passes(gpt2, ids, make_ids):
    other = make_ids(gpt2, seed=1)
    name = "blocks.0.resid_post"
    with hs.capture(gpt2, name, accumulate=True) as cap:
        gpt2(ids)
        gpt2(other)
    want = torch.cat([reference(gpt2, x, [name])[name] for x in (ids, other)])
    assert torch.equal(cap[name], want)


class ZeroesInPlace(nn.Module):
    """Two blocks; between them the model overwrites block 0's output in place."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x: Tensor) -> Tensor:
        h = self.layers[0](x)
        h.mul_(0)
        return self.layers[1](h)


MASK = torch.tensor([[True, False, True], [False, True, True]])


@pytest.mark.parametrize(
    "options, index",
    [
        ({}, ...),
        ({"positions": 1}, (slice(None), 1)),
        ({"positions": slice(0, 2)}, (slice(None), slice(0, 2))),
        ({"dtype": torch.float32}, ...),
        ({"device": "cpu"}, ...),
        ({"token_mask": MASK}, MASK),
    ],
)
def test_capture_is_a_copy(options, index):
    torch.manual_seed(0)
    model, x = ZeroesInPlace().eval(), torch.randn(2, 3, 8)
    with torch.no_grad():
        before = model.layers[0](x)
    assert before.abs().min() > 0
    with hs.capture(model, "blocks.0.resid_post", **options) as cap:  # no stop: mul_(0) runs
        model(x)
    assert torch.equal(cap["blocks.0.resid_post"], before[index])  # the value before mul_(0)


def test_the_name_asked_for_is_a_key_of_what_comes_back(gpt2, ids):
    """A plain name keeps its spelling (a hook_ alias too), a pattern gives canonical keys, and any
    spelling of a captured point reads it (issue 13, item 2)."""
    want = reference(gpt2, ids, ["blocks.0.resid_post", "blocks.1.resid_post", "blocks.2.resid_post"])
    acts = hs.collect(gpt2, ids, ["blocks.0.hook_resid_post", "blocks.*.resid_post"])
    assert list(acts) == ["blocks.0.hook_resid_post", "blocks.1.resid_post", "blocks.2.resid_post"]
    assert torch.equal(acts["blocks.0.hook_resid_post"], want["blocks.0.resid_post"])
    assert torch.equal(acts["blocks.0.resid_post"], want["blocks.0.resid_post"])  # other spelling
    assert "blocks.0.resid_post" in acts and acts.get("blocks.2.hook_resid_post") is not None
    assert torch.equal(acts["blocks.2.resid_post"], want["blocks.2.resid_post"])
    with pytest.raises(KeyError):
        acts["blocks.0.resid_pre"]
    with hs.capture(gpt2, "blocks.1.hook_resid_post") as cap:
        gpt2(ids)
    assert list(cap) == ["blocks.1.hook_resid_post"]
    assert torch.equal(cap["blocks.1.hook_resid_post"], want["blocks.1.resid_post"])
    assert torch.equal(cap["blocks.1.resid_post"], want["blocks.1.resid_post"])
    assert "blocks.1.resid_post" in cap and "blocks.0.resid_post" not in cap
