"""The relations of family_relations.py for image encoders (ViT, CLIP, SigLIP, DINOv2), the
mixture-of-experts decoders and the state-space / recurrent models (Mamba, RWKV): written from
each family's Hugging Face module tree, never from hookscope's tables."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from family_relations import Check, Reads, attention, final, mlp, normed, projections, stream, token_embed
from torch import Tensor, nn

# --- image encoders ---------------------------------------------------------------------------


def _patches(conv: nn.Conv2d, pixels: Tensor) -> Tensor:
    """[batch, 3, H, W] -> [batch, patches, d], patches in row-major order."""
    return conv(pixels).flatten(2).transpose(1, 2)


def _prenorm_block(a: Reads, L: int, blk: nn.Module, names: dict, n_heads: int, scales=None) -> list[Check]:
    """A pre-norm encoder block, its modules named by `names` (ln1, attn, o, ln2, fc1, act, fc2 /
    gate, up, act, down); `scales` (DINOv2's LayerScale) multiply each sublayer's output."""
    p, sub = f"blocks.{L}.", lambda key: blk.get_submodule(names[key])
    x = sub("ln1")(a[p + "resid_pre"])
    checks = normed(a, L, "ln1", a[p + "resid_pre"], sub("ln1")) + [(p + "attn.in", a[p + "attn.in"], x)]
    attn = sub("attn")
    # with LayerScale, o(z) is the sublayer's own output, before the scale
    pre = "_pre_scale" if scales else ""
    checks += attention(a, L, *projections(attn, x), sub("o"), n_heads, out="attn.out" + pre)
    if scales:  # what is added to the stream is the sublayer's output times its LayerScale
        checks.append(
            (
                p + "attn.out = lambda1 * attn.out_pre_scale",
                a[p + "attn.out"],
                a[p + "attn.out_pre_scale"] * scales[0].lambda1,
            )
        )
    checks.append(
        (p + "resid_mid = resid_pre + attn.out", a[p + "resid_mid"], a[p + "resid_pre"] + a[p + "attn.out"])
    )
    x = sub("ln2")(a[p + "resid_mid"])
    checks += normed(a, L, "ln2", a[p + "resid_mid"], sub("ln2"))
    if "gate" in names:
        checks += mlp(a, L, x, sub("gate"), sub("act"), sub("down"), up=sub("up"), out_name="mlp.out" + pre)
    else:
        checks += mlp(a, L, x, sub("fc1"), sub("act"), sub("fc2"), out_name="mlp.out" + pre)
    if scales:
        checks.append(
            (
                p + "mlp.out = lambda2 * mlp.out_pre_scale",
                a[p + "mlp.out"],
                a[p + "mlp.out_pre_scale"] * scales[1].lambda1,
            )
        )
    checks.append(
        (p + "resid_post = resid_mid + mlp.out", a[p + "resid_post"], a[p + "resid_mid"] + a[p + "mlp.out"])
    )
    return checks


def vit_relations(model: nn.Module, pixels: Tensor, a: Reads) -> list[Check]:
    emb, H = model.embeddings, model.config.num_attention_heads
    patches = _patches(emb.patch_embeddings.projection, pixels)
    tokens = torch.cat([emb.cls_token.expand(len(pixels), -1, -1), patches], 1) + emb.position_embeddings
    checks = [
        ("patch_embed = conv(pixels)", a["patch_embed"], patches),
        ("embed = [cls; patches] + pos", a["embed"], tokens),
    ]
    checks += stream(a, len(model.layers), a["embed"])
    names = {
        "ln1": "layernorm_before",
        "attn": "attention",
        "o": "attention.o_proj",
        "ln2": "layernorm_after",
        "fc1": "mlp.fc1",
        "act": "mlp.activation_fn",
        "fc2": "mlp.fc2",
    }
    for L, blk in enumerate(model.layers):
        checks += _prenorm_block(a, L, blk, names, H)
    return checks + final(a, len(model.layers), model.layernorm, None)


def clip_relations(model: nn.Module, pixels: Tensor, a: Reads) -> list[Check]:
    """CLIP and SigLIP; CLIP's post_layernorm normalises only the class token (position 0)."""
    vision, H = model, model.config.num_attention_heads
    emb = vision.embeddings
    patches = _patches(emb.patch_embedding, pixels)
    is_clip = hasattr(vision, "pre_layrnorm")
    if is_clip:
        patches = torch.cat([emb.class_embedding.expand(len(pixels), 1, -1), patches], 1)
    checks = [("embed = [cls;] patches + pos", a["embed"], patches + emb.position_embedding.weight)]
    checks += stream(
        a, len(vision.encoder.layers), vision.pre_layrnorm(a["embed"]) if is_clip else a["embed"]
    )
    names = {
        "ln1": "layer_norm1",
        "attn": "self_attn",
        "o": "self_attn.out_proj",
        "ln2": "layer_norm2",
        "fc1": "mlp.fc1",
        "act": "mlp.activation_fn",
        "fc2": "mlp.fc2",
    }
    for L, blk in enumerate(vision.encoder.layers):
        checks += _prenorm_block(a, L, blk, names, H)
    pick = (lambda last: last[:, 0]) if is_clip else (lambda last: last)
    return checks + final(a, len(vision.encoder.layers), vision.post_layernorm, None, pick)


def dinov2_relations(model: nn.Module, pixels: Tensor, a: Reads) -> list[Check]:
    """Registers (when the model has them) sit between the class token and the patches."""
    emb, cfg = model.embeddings, model.config
    patches = _patches(emb.patch_embeddings.projection, pixels)
    pos = emb.position_embeddings  # the tiny models' pictures have the trained size: no interpolation
    cls = (emb.cls_token + pos[:, :1]).expand(len(pixels), -1, -1)
    parts = [cls] + (
        [emb.register_tokens.expand(len(pixels), -1, -1)] if hasattr(emb, "register_tokens") else []
    )
    tokens = torch.cat(parts + [patches + pos[:, 1:]], 1)
    checks = [
        ("patch_embed = conv(pixels)", a["patch_embed"], patches),
        ("embed = [cls; registers; patches]", a["embed"], tokens),
    ]
    checks += stream(a, len(model.encoder.layer), a["embed"])
    names = {"ln1": "norm1", "attn": "attention", "o": "attention.o_proj", "ln2": "norm2"}
    names |= (
        {"gate": "mlp.gate_proj", "up": "mlp.up_proj", "act": "mlp.act_fn", "down": "mlp.down_proj"}
        if cfg.use_swiglu_ffn
        else {"fc1": "mlp.fc1", "act": "mlp.activation_fn", "fc2": "mlp.fc2"}
    )
    for L, blk in enumerate(model.encoder.layer):
        checks += _prenorm_block(
            a, L, blk, names, cfg.num_attention_heads, (blk.layer_scale1, blk.layer_scale2)
        )
    return checks + final(a, len(model.encoder.layer), model.layernorm, None)


# --- mixture of experts -----------------------------------------------------------------------


def _routing(a: Reads, p: str, x: Tensor, router: nn.Module, k: int, renormalise: bool) -> list[Check]:
    """Router logits = W_router x; the top-k of their softmax (renormalised to sum to 1 where the
    family does) are the weights; `routing` scatters them to [tokens, n_experts]."""
    logits = F.linear(x, router.weight)
    top = torch.softmax(logits, -1).topk(k, -1)
    weights = top.values / top.values.sum(-1, keepdim=True) if renormalise else top.values
    dense = torch.zeros_like(logits).scatter(-1, top.indices, weights)
    return [
        (p + "mlp.router.logits", a[p + "mlp.router.logits"], logits),
        (p + "mlp.router.indices", a[p + "mlp.router.indices"], top.indices),
        (p + "mlp.router.weights", a[p + "mlp.router.weights"], weights),
        (p + "mlp.router.routing", a[p + "mlp.router.routing"], dense),
    ]


def _experts(a: Reads, p: str, x: Tensor, experts: nn.Module) -> list[Check]:
    """Expert E's rows are the tokens routed to it; its activations the gated MLP of its weight
    slices on them; mlp.experts.out the routing-weighted sum of every expert's output per token."""
    checks, total, routing = [], torch.zeros_like(x), a[p + "mlp.router.routing"]
    for e in range(experts.gate_up_proj.shape[0]):
        q = f"{p}mlp.experts.{e}."
        tokens = a[q + "tokens"]
        chose = (a[p + "mlp.router.indices"] == e).any(-1).nonzero().flatten()
        gate, up = F.linear(a[q + "in"], experts.gate_up_proj[e]).chunk(2, dim=-1)
        checks += [
            (q + "tokens = rows that chose e", tokens.sort().values, chose),
            (q + "in = x[tokens]", a[q + "in"], x[tokens]),
            (q + "post = act(gate) * up", a[q + "post"], experts.act_fn(gate) * up),
            (q + "out = W_down post", a[q + "out"], F.linear(a[q + "post"], experts.down_proj[e])),
        ]
        total = total.index_add(0, tokens, a[q + "out"] * routing[tokens, e, None])
    return checks + [(p + "mlp.experts.out = sum routing * expert out", a[p + "mlp.experts.out"], total)]


def _shared_expert(a: Reads, p: str, x: Tensor, moe: nn.Module) -> tuple[list[Check], Tensor]:
    """Qwen2-MoE's shared expert (a gated MLP on every token) and its sigmoid gate; returns the
    checks and what it adds to the layer's output."""
    shared = moe.shared_expert
    checks = [
        (p + "mlp.shared.pre", a[p + "mlp.shared.pre"], shared.gate_proj(x)),
        (p + "mlp.shared.pre_linear", a[p + "mlp.shared.pre_linear"], shared.up_proj(x)),
        (
            p + "mlp.shared.post = act(pre) * pre_linear",
            a[p + "mlp.shared.post"],
            shared.act_fn(a[p + "mlp.shared.pre"]) * a[p + "mlp.shared.pre_linear"],
        ),
        (
            p + "mlp.shared.out = W_down post",
            a[p + "mlp.shared.out"],
            shared.down_proj(a[p + "mlp.shared.post"]),
        ),
        (p + "mlp.shared.gate", a[p + "mlp.shared.gate"], moe.shared_expert_gate(x)),
    ]
    return checks, torch.sigmoid(a[p + "mlp.shared.gate"]) * a[p + "mlp.shared.out"]


def moe_relations(model: nn.Module, ids: Tensor, a: Reads) -> list[Check]:
    base, cfg = model.model, model.config
    renormalise = getattr(cfg, "norm_topk_prob", True)  # Mixtral always renormalises
    checks = [token_embed(a, base.embed_tokens, ids)] + stream(a, len(base.layers), a["embed"])
    for L, blk in enumerate(base.layers):
        p = f"blocks.{L}."
        x = blk.input_layernorm(a[p + "resid_pre"])
        checks += normed(a, L, "ln1", a[p + "resid_pre"], blk.input_layernorm)
        checks.append((p + "attn.in", a[p + "attn.in"], x))
        checks += attention(
            a, L, *projections(blk.self_attn, x), blk.self_attn.o_proj, cfg.num_attention_heads
        )
        checks.append(
            (
                p + "resid_mid = resid_pre + attn.out",
                a[p + "resid_mid"],
                a[p + "resid_pre"] + a[p + "attn.out"],
            )
        )
        checks += normed(a, L, "ln2", a[p + "resid_mid"], blk.post_attention_layernorm)
        x = blk.post_attention_layernorm(a[p + "resid_mid"])
        checks.append((p + "mlp.in = ln2(resid_mid), the router's input", a[p + "mlp.in"], x))
        x = x.flatten(0, 1)  # one row per token
        checks += _routing(a, p, x, blk.mlp.gate, cfg.num_experts_per_tok, renormalise)
        checks += _experts(a, p, x, blk.mlp.experts)
        out = a[p + "mlp.experts.out"]
        if hasattr(blk.mlp, "shared_expert"):
            shared, added = _shared_expert(a, p, x, blk.mlp)
            checks, out = checks + shared, out + added
        checks += [
            (p + "mlp.out = experts (+ shared)", a[p + "mlp.out"], out.view_as(a[p + "resid_mid"])),
            (
                p + "resid_post = resid_mid + mlp.out",
                a[p + "resid_post"],
                a[p + "resid_mid"] + a[p + "mlp.out"],
            ),
        ]
    return checks + final(a, len(base.layers), base.norm, model.lm_head)


# --- state-space and recurrent models ---------------------------------------------------------


def mamba_relations(model: nn.Module, ids: Tensor, a: Reads) -> list[Check]:
    """Mamba and Falcon-Mamba: resid_post = resid_pre + mixer(norm(resid_pre)); the mixer's output
    is out_proj of its gated scan output."""
    base = model.backbone
    checks = [token_embed(a, base.embeddings, ids)] + stream(a, len(base.layers), a["embed"])
    for L, blk in enumerate(base.layers):
        p = f"blocks.{L}."
        checks += [
            (p + "mixer.in = norm(resid_pre)", a[p + "mixer.in"], blk.norm(a[p + "resid_pre"])),
            (
                p + "mixer.in_proj = in_proj(mixer.in)",
                a[p + "mixer.in_proj"],
                blk.mixer.in_proj(a[p + "mixer.in"]),
            ),
            (p + "mixer.out = mixer(mixer.in)", a[p + "mixer.out"], blk.mixer(a[p + "mixer.in"])),
            (
                p + "mixer.out = out_proj(ssm_out)",
                a[p + "mixer.out"],
                blk.mixer.out_proj(a[p + "mixer.ssm_out"]),
            ),
            (
                p + "resid_post = resid_pre + mixer.out",
                a[p + "resid_post"],
                a[p + "resid_pre"] + a[p + "mixer.out"],
            ),
        ]
    return checks + final(a, len(base.layers), base.norm_f, model.lm_head)


def rwkv_relations(model: nn.Module, ids: Tensor, a: Reads) -> list[Check]:
    """Time mixing then channel mixing, each added to the stream; block 0 normalises its input
    first (pre_ln). The tiny model has fewer blocks than rescale_every: no halving between blocks."""
    base = model.rwkv
    checks = [token_embed(a, base.embeddings, ids)] + stream(a, len(base.blocks), a["embed"])
    for L, blk in enumerate(base.blocks):
        p = f"blocks.{L}."
        stream_in = blk.pre_ln(a[p + "resid_pre"]) if L == 0 else a[p + "resid_pre"]
        checks += [
            (p + "mixer.in = ln1(resid_pre)", a[p + "mixer.in"], blk.ln1(stream_in)),
            (p + "mixer.out = attention(mixer.in)", a[p + "mixer.out"], blk.attention(a[p + "mixer.in"])[0]),
            (p + "resid_mid = resid_pre + mixer.out", a[p + "resid_mid"], stream_in + a[p + "mixer.out"]),
            (p + "mlp.in = ln2(resid_mid)", a[p + "mlp.in"], blk.ln2(a[p + "resid_mid"])),
            (p + "mlp.out = feed_forward(mlp.in)", a[p + "mlp.out"], blk.feed_forward(a[p + "mlp.in"])[0]),
            (
                p + "resid_post = resid_mid + mlp.out",
                a[p + "resid_post"],
                a[p + "resid_mid"] + a[p + "mlp.out"],
            ),
        ]
    return checks + final(a, len(base.blocks), base.ln_out, model.head)
