"""What each point must equal, written from the Hugging Face module tree of each family and never
from hookscope's tables: `resid_mid = resid_pre + attn.out`, `mlp.post = act(mlp.pre)`,
`blocks.L.resid_pre = blocks.(L-1).resid_post`, a MoE layer's output = the routed sum of its
experts, ... A table entry naming the wrong module (a neighbour, input for output, the layer
before) breaks at least one of these, whatever module it names.

Each `*_relations(model, ids_or_pixels, acts)` returns (label, got, want) triples; `acts` is a
`Reads` that records which points were used, so the test can require every point to be held by
some relation."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

Check = tuple[str, Tensor, Tensor]


def same(x: Tensor) -> Tensor:
    return x


class Reads:
    """The captured points, remembering which ones a relation read."""

    def __init__(self, acts: dict[str, Tensor]):
        self.acts, self.read = acts, set()

    def __getitem__(self, name: str) -> Tensor:
        self.read.add(name)
        return self.acts[name]


def _heads(x: Tensor, n: int) -> Tensor:
    return x.unflatten(-1, (n, -1))


def attention(
    a: Reads,
    L: int,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Callable[[Tensor], Tensor],
    n_heads: int,
    out: str = "attn.out",
) -> list[Check]:
    """Per-head points against the projections of the block's normed input (q, k, v: those
    projections, [batch, pos, heads * d_head], computed by the caller); z through the output
    projection is `out` (attn.out, or attn.out_pre_norm where a norm follows); each pattern row is
    a distribution and pattern @ v = z (grouped k / v heads repeated)."""
    p = f"blocks.{L}."
    n_kv = n_heads * k.shape[-1] // q.shape[-1]
    z, pattern = a[p + "attn.z"], a[p + "attn.pattern"]
    v_per_head = _heads(v, n_kv).repeat_interleave(n_heads // n_kv, dim=2)
    return [
        (p + "attn.q", a[p + "attn.q"], _heads(q, n_heads)),
        (p + "attn.k", a[p + "attn.k"], _heads(k, n_kv)),
        (p + "attn.v", a[p + "attn.v"], _heads(v, n_kv)),
        (p + out + " = o(z)", a[p + out], o(z.flatten(-2))),
        (p + "attn.pattern rows sum to 1", pattern.sum(-1), torch.ones_like(pattern[..., 0])),
        (p + "attn.z = pattern @ v", z, torch.einsum("bhqk,bkhd->bqhd", pattern, v_per_head)),
    ]


def projections(attn: nn.Module, x: Tensor, names=("q_proj", "k_proj", "v_proj")) -> tuple:
    return tuple(getattr(attn, n)(x) for n in names)


def mlp(
    a: Reads,
    L: int,
    x: Tensor,
    pre: nn.Module,
    act: Callable,
    out: nn.Module,
    up: nn.Module | None = None,
    out_name: str = "mlp.out",
) -> list[Check]:
    """mlp.in = x, the normed input; mlp.pre = W_in(x); mlp.post = act(pre) (gated: act(gate) *
    up(x)); `out_name` (mlp.out, or mlp.out_pre_norm where a norm follows) = W_out(post)."""
    p = f"blocks.{L}."
    checks = [
        (p + "mlp.in = what the MLP reads", a[p + "mlp.in"], x),
        (p + "mlp.pre", a[p + "mlp.pre"], pre(x)),
    ]
    post = act(a[p + "mlp.pre"])
    if up is not None:
        checks.append((p + "mlp.pre_linear", a[p + "mlp.pre_linear"], up(x)))
        post = post * a[p + "mlp.pre_linear"]
    return checks + [
        (p + "mlp.post = act(mlp.pre)", a[p + "mlp.post"], post),
        (p + out_name + " = W_out(mlp.post)", a[p + out_name], out(a[p + "mlp.post"])),
    ]


# norms that keep their eps in the forward's code (OLMo's weightless LayerNorm)
_FIXED_EPS = {"OlmoLayerNorm": 1e-5}


def normed(a: Reads, L: int, ln: str, x: Tensor, norm: nn.Module) -> list[Check]:
    """TransformerLens's `ln.scale` and `ln.normalized` of the norm `norm` reading x: (x - mean)
    / sqrt(var + eps) for a LayerNorm, x / sqrt(mean(x^2) + eps) for an RMSNorm (no weight, no
    bias), by hand from the norm's eps."""
    return _normed(a, f"blocks.{L}.{ln}.", x, norm)


def _normed(a: Reads, p: str, x: Tensor, norm: nn.Module) -> list[Check]:
    eps = _FIXED_EPS.get(type(norm).__name__) or next(
        getattr(norm, n) for n in ("eps", "variance_epsilon") if hasattr(norm, n)
    )
    centred = x - x.mean(-1, keepdim=True) if "RMS" not in type(norm).__name__ else x
    scale = (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    return [(p + "scale", a[p + "scale"], scale), (p + "normalized", a[p + "normalized"], centred / scale)]


def stream(a: Reads, n_layers: int, first: Tensor) -> list[Check]:
    """blocks.0.resid_pre is what the embeddings give; each later block reads the one before."""
    checks = [("blocks.0.resid_pre = embeddings", a["blocks.0.resid_pre"], first)]
    for L in range(1, n_layers):
        checks.append(
            (
                f"blocks.{L}.resid_pre = blocks.{L - 1}.resid_post",
                a[f"blocks.{L}.resid_pre"],
                a[f"blocks.{L - 1}.resid_post"],
            )
        )
    return checks


def final(
    a: Reads, n_layers: int, norm: nn.Module, head: nn.Module | None, pick: Callable[[Tensor], Tensor] = same
) -> list[Check]:
    """ln_final is the final norm of the last block's output (of `pick` of it), and, where the
    family has them, ln_final.scale / ln_final.normalized its scale and its input / scale, before
    its weight (by hand, as ln1 / ln2's); logits the head's."""
    last = a[f"blocks.{n_layers - 1}.resid_post"]
    checks = [("ln_final = norm(last resid_post)", a["ln_final"], norm(pick(last)))]
    if "ln_final.normalized" in a.acts:
        checks += _normed(a, "ln_final.", pick(last), norm)
    if head is not None:
        checks.append(("logits = head(ln_final)", a["logits"], head(a["ln_final"])))
    return checks


def token_embed(a: Reads, embedding: nn.Embedding, ids: Tensor, scale: float = 1.0) -> Check:
    return ("embed = W_E[ids]", a["embed"], embedding.weight[ids] * scale)


# --- decoders and BERT ------------------------------------------------------------------------


def gpt2_relations(model: nn.Module, ids: Tensor, a: Reads) -> list[Check]:
    base, d, H = model.transformer, model.config.n_embd, model.config.n_head
    pos = base.wpe.weight[torch.arange(ids.shape[1])][None]  # the same for every sequence
    checks = [token_embed(a, base.wte, ids), ("pos_embed = W_pos[positions]", a["pos_embed"], pos)]
    checks += stream(a, len(base.h), a["embed"] + a["pos_embed"])
    for L, blk in enumerate(base.h):
        p, x = f"blocks.{L}.", blk.ln_1(a[f"blocks.{L}.resid_pre"])
        checks += normed(a, L, "ln1", a[p + "resid_pre"], blk.ln_1) + [(p + "attn.in", a[p + "attn.in"], x)]
        q, k, v = blk.attn.c_attn(x).split(d, dim=-1)  # c_attn's output is [q | k | v]
        checks += attention(a, L, q, k, v, blk.attn.c_proj, H)
        checks += [
            (
                p + "resid_mid = resid_pre + attn.out",
                a[p + "resid_mid"],
                a[p + "resid_pre"] + a[p + "attn.out"],
            )
        ]
        checks += normed(a, L, "ln2", a[p + "resid_mid"], blk.ln_2)
        checks += mlp(a, L, blk.ln_2(a[p + "resid_mid"]), blk.mlp.c_fc, blk.mlp.act, blk.mlp.c_proj)
        checks += [
            (
                p + "resid_post = resid_mid + mlp.out",
                a[p + "resid_post"],
                a[p + "resid_mid"] + a[p + "mlp.out"],
            )
        ]
    return checks + final(a, len(base.h), base.ln_f, model.lm_head)


# Llama-style decoders that normalise a sublayer's output before adding it to the residual, and
# OLMo 2, which normalises only there (no norm before attention or the MLP). TransformerLens's
# attn.out / mlp.out are the normalised outputs, "that which is added to the residual stream".
_NORMED_SUBLAYERS = {
    "gemma2": ("post_attention_layernorm", "post_feedforward_layernorm"),
    "gemma3_text": ("post_attention_layernorm", "post_feedforward_layernorm"),
    "olmo2": ("post_attention_layernorm", "post_feedforward_layernorm"),
}
_MLP_NORM = {"gemma2": "pre_feedforward_layernorm", "gemma3_text": "pre_feedforward_layernorm", "olmo2": None}
_EMBED_SCALE = {"gemma", "gemma2", "gemma3_text"}  # embeddings times sqrt(d_model)


def llama_relations(model: nn.Module, ids: Tensor, a: Reads) -> list[Check]:
    base, cfg = model.model, model.config
    kind = cfg.model_type
    scale = cfg.hidden_size**0.5 if kind in _EMBED_SCALE else 1.0
    after_attn, after_mlp = _NORMED_SUBLAYERS.get(kind, (None, None))
    mlp_norm = _MLP_NORM.get(kind, "post_attention_layernorm")
    checks = [token_embed(a, base.embed_tokens, ids, scale)] + stream(a, len(base.layers), a["embed"])
    for L, blk in enumerate(base.layers):
        p = f"blocks.{L}."
        x = a[p + "resid_pre"]
        if hasattr(blk, "input_layernorm"):
            checks += normed(a, L, "ln1", x, blk.input_layernorm)
            x = blk.input_layernorm(x)
        checks.append((p + "attn.in = what attention reads", a[p + "attn.in"], x))
        out = "attn.out_pre_norm" if after_attn else "attn.out"
        checks += attention(
            a, L, *projections(blk.self_attn, x), blk.self_attn.o_proj, cfg.num_attention_heads, out
        )
        if after_attn:
            checks.append(
                (
                    p + "attn.out = post-norm(attn.out_pre_norm)",
                    a[p + "attn.out"],
                    getattr(blk, after_attn)(a[p + out]),
                )
            )
        checks.append(
            (
                p + "resid_mid = resid_pre + attn.out",
                a[p + "resid_mid"],
                a[p + "resid_pre"] + a[p + "attn.out"],
            )
        )
        x = a[p + "resid_mid"]
        if mlp_norm:
            checks += normed(a, L, "ln2", x, getattr(blk, mlp_norm))
            x = getattr(blk, mlp_norm)(x)
        out = "mlp.out_pre_norm" if after_mlp else "mlp.out"
        checks += mlp(
            a, L, x, blk.mlp.gate_proj, blk.mlp.act_fn, blk.mlp.down_proj, up=blk.mlp.up_proj, out_name=out
        )
        if after_mlp:
            checks.append(
                (
                    p + "mlp.out = post-norm(mlp.out_pre_norm)",
                    a[p + "mlp.out"],
                    getattr(blk, after_mlp)(a[p + out]),
                )
            )
        checks.append(
            (
                p + "resid_post = resid_mid + mlp.out",
                a[p + "resid_post"],
                a[p + "resid_mid"] + a[p + "mlp.out"],
            )
        )
    return checks + final(a, len(base.layers), base.norm, model.lm_head)


def neox_relations(model: nn.Module, ids: Tensor, a: Reads) -> list[Check]:
    base, cfg = model.gpt_neox, model.config
    H = cfg.num_attention_heads
    checks = [token_embed(a, base.embed_in, ids)] + stream(a, len(base.layers), a["embed"])
    for L, blk in enumerate(base.layers):
        p, x = f"blocks.{L}.", blk.input_layernorm(a[f"blocks.{L}.resid_pre"])
        checks += normed(a, L, "ln1", a[p + "resid_pre"], blk.input_layernorm)
        checks.append((p + "attn.in", a[p + "attn.in"], x))
        fused = blk.attention.query_key_value(x).unflatten(-1, (H, -1))  # per head [q_h | k_h | v_h]
        q, k, v = (part.flatten(-2) for part in fused.chunk(3, dim=-1))
        checks += attention(a, L, q, k, v, blk.attention.dense, H)
        if cfg.use_parallel_residual:  # attention and MLP both read resid_pre
            into_mlp = a[p + "resid_pre"]
            total = a[p + "resid_pre"] + a[p + "attn.out"] + a[p + "mlp.out"]
        else:
            checks.append(
                (
                    p + "resid_mid = resid_pre + attn.out",
                    a[p + "resid_mid"],
                    a[p + "resid_pre"] + a[p + "attn.out"],
                )
            )
            into_mlp, total = a[p + "resid_mid"], a[p + "resid_mid"] + a[p + "mlp.out"]
        mlp_in = blk.post_attention_layernorm(into_mlp)
        checks += normed(a, L, "ln2", into_mlp, blk.post_attention_layernorm)
        checks += mlp(a, L, mlp_in, blk.mlp.dense_h_to_4h, blk.mlp.act, blk.mlp.dense_4h_to_h)
        checks.append((p + "resid_post = sum of what the block adds", a[p + "resid_post"], total))
    return checks + final(a, len(base.layers), base.final_layer_norm, model.lm_head)


def bert_relations(model: nn.Module, ids: Tensor, a: Reads) -> list[Check]:
    """Post-LayerNorm: each sublayer's sum with its input is normalised (resid_mid / resid_post
    are the normalised values)."""
    emb, H = model.embeddings, model.config.num_attention_heads
    pos = emb.position_embeddings.weight[torch.arange(ids.shape[1])][None]
    first = emb.LayerNorm(a["embed"] + a["pos_embed"] + emb.token_type_embeddings.weight[0])
    checks = [token_embed(a, emb.word_embeddings, ids), ("pos_embed = W_pos[positions]", a["pos_embed"], pos)]
    checks += stream(a, len(model.encoder.layer), first)
    for L, blk in enumerate(model.encoder.layer):
        p, x = f"blocks.{L}.", a[f"blocks.{L}.resid_pre"]
        att = blk.attention
        checks.append((p + "attn.in = resid_pre (post-LN: no norm before attention)", a[p + "attn.in"], x))
        checks += attention(a, L, *projections(att.self, x, ("query", "key", "value")), att.output.dense, H)
        checks.append(
            (
                p + "resid_mid = LN(resid_pre + attn.out)",
                a[p + "resid_mid"],
                att.output.LayerNorm(a[p + "resid_pre"] + a[p + "attn.out"]),
            )
        )
        checks += mlp(
            a,
            L,
            a[p + "resid_mid"],
            blk.intermediate.dense,
            blk.intermediate.intermediate_act_fn,
            blk.output.dense,
        )
        checks.append(
            (
                p + "resid_post = LN(resid_mid + mlp.out)",
                a[p + "resid_post"],
                blk.output.LayerNorm(a[p + "resid_mid"] + a[p + "mlp.out"]),
            )
        )
    return checks
