"""Point tables on vLLM's own model classes: TransformerLens's names with TransformerLens's meaning.

vLLM's decoder layers (Llama, Qwen2/3, Gemma 2/3) take `(positions, hidden, residual)` and return
`(hidden, residual)`: the residual add is deferred into the next fused norm (`norm(hidden, residual)`
adds, then normalises), and layer 0 gets `residual=None`. So the residual stream is never one
tensor at a module boundary: `resid_pre` / `resid_mid` / `resid_post` are read as `hidden + residual`
from the layer's input, the fused norm's input and the layer's output. An edit writes the new stream
as `hidden` with a zero residual, which the next fused add turns back into the stream.

q / k / v come out of one fused `qkv_proj` (split by sizes: grouped-query k / v are narrower), the
gate and up projections out of one `gate_up_proj` (split in halves). Activations are
`[tokens, ...]`: the tokens of every request in the forward, flattened (`POS_DIM`). The
mixture-of-experts families (`moe_like`) name what vLLM keeps apart from its fused MoE kernel and
refuse by name what it never materialises (`MOE_REFUSED`).
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import Tensor

from ...arch import moe
from ...arch.base import Arch, Call, View, build, fused_heads, heads, sum_of
from ...errors import EngineError, UnknownPointError
from ...names import canonical, is_pattern, layer_of

POS_DIM = 0  # vLLM's activations have no batch dim: [num_tokens, ...]


# --- the residual stream put back ---------------------------------------------------------------


def _as(new: Tensor, like: Tensor) -> Tensor:
    """`new` in `like`'s dtype (a no-op `.to` is still a dispatch, on every forward of an edit)."""
    return new if new.dtype == like.dtype else new.to(like.dtype)


def _stream_in(call: Call, first: int) -> Tensor:
    """`hidden + residual` from a call whose hidden states are argument `first` and the residual
    the one after it (None or absent at layer 0 / a plain norm)."""
    hidden = call.args[first]
    residual = call.args[first + 1] if len(call.args) > first + 1 else call.kwargs.get("residual")
    return hidden if residual is None else hidden + residual


def _stream_in_put(first: int):
    def put(call: Call, new: Tensor) -> Call:
        args = list(call.args)
        args[first] = _as(new, args[first])
        if len(args) > first + 1:
            args[first + 1] = torch.zeros_like(args[first])
        kwargs = (
            {**call.kwargs, "residual": torch.zeros_like(args[first])}
            if "residual" in call.kwargs
            else call.kwargs
        )
        return Call(call.module, tuple(args), kwargs)

    return put


def stream_in(first: int) -> View:
    """The residual stream entering a module called `(..., hidden, residual)`."""
    return View(lambda call: _stream_in(call, first), _stream_in_put(first), "hidden + residual (fused add)")


STREAM_OUT = View(
    get=lambda out: out[0] + out[1],
    put=lambda out, new: (_as(new, out[0]), torch.zeros_like(out[1])),
    label="hidden + residual (fused add)",
)


def refused_write(why: str):
    """A view's `put` for a point that cannot be written on vLLM, `why` checked before any work
    (`read_only`)."""

    def put(raw, new: Tensor):
        raise EngineError(why)

    put.why = why
    return put


_NORMALIZED_WRITE = refused_write(
    "ln1.normalized / ln2.normalized / ln_final.normalized are computed from the norm's input: edit "
    "attn.in / mlp.in or the residual stream (resid_pre / resid_mid) instead"
)


def _normalized(call: Call, centred: bool) -> Tensor:
    """TransformerLens's `lnX.normalized`: the norm's input (the fused sum) over its scale, before
    the norm's weight, computed in float32 as TransformerLens does."""
    x = _stream_in(call, 0)
    dtype = x.dtype
    x = x.float() if dtype not in (torch.float32, torch.float64) else x
    if centred:
        x = x - x.mean(-1, keepdim=True)
    eps = getattr(call.module, "variance_epsilon", None) or call.module.eps
    return (x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()).to(dtype)


def read_only(spec) -> str | None:
    """Why the point cannot be written on vLLM (`lnX.normalized`, the router's logits); None where
    it can."""
    return getattr(spec.view.put, "why", None) if spec.view is not None else None


RMS_NORMALIZED = View(
    lambda call: _normalized(call, False), _NORMALIZED_WRITE, "computed: (hidden + residual) / scale"
)
LN_NORMALIZED = View(
    lambda call: _normalized(call, True), _NORMALIZED_WRITE, "computed: centred input / scale"
)
CALL = {"item": None}  # the spec reads the module's whole call (a `Call`) or whole output


def split_heads(part: int, sizes: tuple[int, int, int], n_heads: int) -> View:
    """One of q / k / v from a fused `qkv_proj` output of widths `sizes` (k / v narrower with
    grouped-query attention), split into heads."""

    def get(raw: Tensor) -> Tensor:
        return raw.split(sizes, dim=-1)[part].unflatten(-1, (n_heads, -1))

    def put(raw: Tensor, new: Tensor) -> Tensor:
        parts = list(raw.split(sizes, dim=-1))
        parts[part] = new.to(raw.dtype).flatten(-2)
        return torch.cat(parts, dim=-1)

    return View(
        get,
        put,
        f"part {part} of fused qkv {sizes}, {n_heads} heads",
        head_dim=-2,
        # one tensor-parallel rank's qkv_proj output: its 1/n of each of q, k and v, fused alike
        split=lambda n: split_heads(part, tuple(size // n for size in sizes), n_heads // n),
    )


def half(part: int) -> View:
    """The gate (0) or up (1) half of a fused `gate_up_proj` output."""

    def put(raw: Tensor, new: Tensor) -> Tensor:
        parts = list(raw.chunk(2, dim=-1))
        parts[part] = new.to(raw.dtype)
        return torch.cat(parts, dim=-1)

    return View(
        lambda raw: raw.chunk(2, dim=-1)[part],
        put,
        f"{'gate' if part == 0 else 'up'} half of gate_up",
        # one tensor-parallel rank's gate_up_proj output is its gate columns, then its up columns
        split=lambda n: half(part),
    )


def concatenated_heads(part: int, n_heads: int) -> View:
    """One of q / k / v from GPT-2's fused c_attn ([q | k | v]); one tensor-parallel rank's c_attn
    output is [its q | its k | its v], the same layout with fewer heads."""
    view = fused_heads(part, 3, n_heads)
    return dataclasses.replace(view, split=lambda n: concatenated_heads(part, n_heads // n))


# --- points vLLM's kernels do not expose ----------------------------------------------------------

# suffix -> why not, and what to use instead: refused by name (`Refused` in vllm/__init__.py)
REFUSED = {
    "attn.pattern": "vLLM's attention kernels (paged / flash) never materialise the attention weights; "
    "read attn.q and attn.k (and compute softmax(q k^T / sqrt(d_head)) for one request) or attn.z",
    "logits": "vLLM computes logits only for the tokens it samples, outside the model's forward; read "
    "ln_final (what the unembedding reads) or ask vLLM for logprobs in SamplingParams",
    "attn.in_pre_norm": "the residual stream before ln1 is resid_pre on vLLM (no separate copy exists)",
    "mlp.in_pre_norm": "the residual stream before ln2 is resid_mid on vLLM (no separate copy exists)",
}


# --- the families ----------------------------------------------------------------------------------


def _attention(config, *, post_norm: bool) -> dict:
    H = config.num_attention_heads
    KV = getattr(config, "num_key_value_heads", None) or H
    d_head = getattr(config, "head_dim", None) or config.hidden_size // H
    sizes = (H * d_head, KV * d_head, KV * d_head)
    attn = "layers.{L}.self_attn"
    out = (
        {
            "attn.out_pre_norm": (attn, "output", None),
            "attn.out": ("layers.{L}.post_attention_layernorm", "output", None),
        }
        if post_norm
        else {"attn.out": (attn, "output", None)}
    )
    return {
        # the layer is called (positions, hidden, residual)
        "resid_pre": ("layers.{L}", "input", stream_in(1), CALL),
        "ln1.normalized": ("layers.{L}.input_layernorm", "input", RMS_NORMALIZED, CALL),
        "attn.in": (attn, "input", None),
        "attn.q": (f"{attn}.qkv_proj", "output", split_heads(0, sizes, H)),
        "attn.k": (f"{attn}.qkv_proj", "output", split_heads(1, sizes, KV)),
        "attn.v": (f"{attn}.qkv_proj", "output", split_heads(2, sizes, KV)),
        "attn.z": (f"{attn}.o_proj", "input", heads(H)),
        **out,
    }


def gated_mlp(module: str, name: str) -> dict:
    """The points of a gated MLP `module` (fused gate_up_proj, down_proj), named `name`.pre etc."""
    return {
        f"{name}.pre": (f"{module}.gate_up_proj", "output", half(0)),
        f"{name}.pre_linear": (f"{module}.gate_up_proj", "output", half(1)),
        f"{name}.post": (f"{module}.down_proj", "input", None),
    }


def llama_like(
    config, *, post_norm: bool = False, mlp: str = "layers.{L}.mlp", inner: dict | None = None
) -> dict:
    """Llama, Mistral, Qwen2, Qwen3 (`post_norm`: Gemma 2 / 3's sandwich norms, where attn.out /
    mlp.out are the post-norm outputs, as in arch/llama.py). `mlp`: the MLP block's module;
    `inner`: its points between mlp.in and mlp.out (default: the gated MLP's)."""
    ln2 = "pre_feedforward_layernorm" if post_norm else "post_attention_layernorm"
    out = (
        {
            "mlp.out_pre_norm": (mlp, "output", None),
            "mlp.out": ("layers.{L}.post_feedforward_layernorm", "output", None),
        }
        if post_norm
        else {"mlp.out": (mlp, "output", None)}
    )
    return {
        **_attention(config, post_norm=post_norm),
        # ln2 is the fused norm called (hidden = attn.out, residual = resid_pre): its input sum
        "resid_mid": (f"layers.{{L}}.{ln2}", "input", stream_in(0), CALL),
        "ln2.normalized": (f"layers.{{L}}.{ln2}", "input", RMS_NORMALIZED, CALL),
        "mlp.in": (mlp, "input", None),
        **(gated_mlp(mlp, "mlp") if inner is None else inner),
        **out,
        "resid_post": ("layers.{L}", "output", STREAM_OUT, CALL),
    }


# --- mixture-of-experts decoders -------------------------------------------------------------------

# vLLM's MoE block (Mixtral's `block_sparse_moe`, the others' `mlp`) calls its router `gate`, a
# linear returning (logits, bias), then one `experts` module (the fused MoE layer's runner), which
# picks each token's top-k experts and runs every expert in one fused kernel call
ROUTER_LOGITS = View(
    lambda raw: raw,
    refused_write(
        "vLLM routes on the logits its router returns, while Hugging Face's router has already picked "
        "the experts when it returns them, so a write would mean different things on the two: edit the "
        "routing on the Hugging Face model (hookscope.experts)"
    ),
    "the router's logits",
)

_ON_HUGGING_FACE = "or capture it with hookscope on the Hugging Face model (hs.load(path))"
_ROUTING = (
    "vLLM's fused MoE layer picks each token's top-k experts inside its call (no module returns the "
    f"weights or indices): read mlp.router.logits (softmax, then top-k), {_ON_HUGGING_FACE}"
)
_PER_EXPERT = (
    "vLLM's fused MoE kernel runs every expert in one call and never materialises one expert's rows, "
    f"hidden activations or output: read mlp.in and mlp.out here, {_ON_HUGGING_FACE}"
)
# suffix (expert index as {E}) -> why not: refused by name on the MoE families' tables (`refusal`)
MOE_REFUSED = {
    "mlp.router.weights": _ROUTING,
    "mlp.router.indices": _ROUTING,
    "mlp.router.routing": _ROUTING,
    **{f"mlp.experts.{{E}}.{what}": _PER_EXPERT for what in ("tokens", "in", "post", "out")},
    # only where the table lacks it: Qwen2-MoE's shared expert runs inside the same call
    "mlp.experts.out": "vLLM's fused MoE layer adds the shared expert's output to the routed experts' "
    "inside one call: read mlp.out (the sum), mlp.shared.out and mlp.shared.gate (the shared part is "
    f"sigmoid(gate) * out), {_ON_HUGGING_FACE}",
}


def moe_like(config, block: str = "mlp") -> dict:
    """Mixtral (`block`: block_sparse_moe), Qwen2-MoE, Qwen3-MoE, OLMoE: attention as Llama's; of
    the MoE block, what vLLM keeps apart from its fused kernel (arch/moe.py names the same points on
    Hugging Face): the router's logits, Qwen2-MoE's shared expert (its own module, whose output
    vLLM multiplies by the sigmoid of shared_expert_gate inside), the routed experts' sum."""
    mlp = f"layers.{{L}}.{block}"
    inner = {"mlp.router.logits": (f"{mlp}.gate", "output", ROUTER_LOGITS)}
    if getattr(config, "shared_expert_intermediate_size", 0):
        shared = f"{mlp}.shared_expert"
        inner.update(
            {
                **gated_mlp(shared, "mlp.shared"),
                "mlp.shared.out": (f"{shared}.down_proj", "output", None),
                "mlp.shared.gate": (f"{mlp}.shared_expert_gate", "output", None),
            }
        )
    else:
        inner["mlp.experts.out"] = (f"{mlp}.experts", "output", None)
    return llama_like(config, mlp=mlp, inner=inner)


def _moe_decoder(config, block: str = "mlp") -> Arch:
    dense = [L for L in range(config.num_hidden_layers) if not moe.is_sparse(config, L)]
    if dense:
        raise EngineError(
            f"{config.model_type} with dense MLP layers {dense} (mlp_only_layers / decoder_sparse_step): "
            "hookscope's vLLM tables describe all-sparse models only; load the checkpoint with "
            "hs.load(path) (Hugging Face) to read its points"
        )
    return _decoder(config, moe_like(config, block))


def _decoder(config, per_layer: dict) -> Arch:
    return build(
        config.model_type,
        "model.",
        config.num_hidden_layers,
        "layers.{L}",
        # the stream into layer 0: the embedding, scaled where the family scales it (Gemma's
        # embed_input_ids multiplies embed_tokens' output by sqrt(d_model), as Hugging Face's
        # scaled embedding module does inside: the same meaning)
        top={"embed": ("layers.0", "input", stream_in(1), CALL)},
        per_layer=per_layer,
        final={
            "ln_final.normalized": ("norm", "input", RMS_NORMALIZED, CALL),
            "ln_final": ("norm", "output", None),
        },
        n_heads=config.num_attention_heads,
        d_model=config.hidden_size,
    )


def _gpt2(config) -> Arch:
    H = config.n_head
    return build(
        "gpt2",
        "transformer.",
        config.n_layer,
        "h.{L}",
        top={"embed": ("wte", "output", None), "pos_embed": ("wpe", "output", None)},
        per_layer={
            "resid_pre": ("h.{L}", "input", None),
            "ln1.normalized": ("h.{L}.ln_1", "input", LN_NORMALIZED, CALL),
            "attn.in": ("h.{L}.attn", "input", None),
            "attn.q": ("h.{L}.attn.c_attn", "output", concatenated_heads(0, H)),
            "attn.k": ("h.{L}.attn.c_attn", "output", concatenated_heads(1, H)),
            "attn.v": ("h.{L}.attn.c_attn", "output", concatenated_heads(2, H)),
            "attn.z": ("h.{L}.attn.c_proj", "input", heads(H)),
            "attn.out": ("h.{L}.attn", "output", None),
            # written as resid_pre + attn.out: the block keeps its own residual, which ln_2's input is not
            "resid_mid": ("h.{L}.ln_2", "input", None, sum_of("h.{L}.ln_1", "attn.out")),
            "ln2.normalized": ("h.{L}.ln_2", "input", LN_NORMALIZED, CALL),
            "mlp.in": ("h.{L}.mlp", "input", None),
            "mlp.pre": ("h.{L}.mlp.c_fc", "output", None),
            "mlp.post": ("h.{L}.mlp.c_proj", "input", None),
            "mlp.out": ("h.{L}.mlp", "output", None),
            "resid_post": ("h.{L}", "output", None),
        },
        final={
            "ln_final.normalized": ("ln_f", "input", LN_NORMALIZED, CALL),
            "ln_final": ("ln_f", "output", None),
        },
        n_heads=H,
        d_model=config.n_embd,
    )


# Hugging Face architecture (config.architectures[0]) -> (vLLM's model class, table builder). The
# class is checked in the worker: vLLM runs some architectures through its Transformers backend
# (GPT-NeoX, OLMo 2 in 0.32), whose module tree these tables do not describe.
FAMILIES = {
    "LlamaForCausalLM": ("LlamaForCausalLM", lambda c: _decoder(c, llama_like(c))),
    "MistralForCausalLM": ("MistralForCausalLM", lambda c: _decoder(c, llama_like(c))),
    "Qwen2ForCausalLM": ("Qwen2ForCausalLM", lambda c: _decoder(c, llama_like(c))),
    "Qwen3ForCausalLM": ("Qwen3ForCausalLM", lambda c: _decoder(c, llama_like(c))),
    "Gemma2ForCausalLM": ("Gemma2ForCausalLM", lambda c: _decoder(c, llama_like(c, post_norm=True))),
    "Gemma3ForCausalLM": ("Gemma3ForCausalLM", lambda c: _decoder(c, llama_like(c, post_norm=True))),
    "GPT2LMHeadModel": ("GPT2LMHeadModel", _gpt2),
    "MixtralForCausalLM": ("MixtralForCausalLM", lambda c: _moe_decoder(c, "block_sparse_moe")),
    "Qwen2MoeForCausalLM": ("Qwen2MoeForCausalLM", _moe_decoder),
    "Qwen3MoeForCausalLM": ("Qwen3MoeForCausalLM", _moe_decoder),
    "OlmoeForCausalLM": ("OlmoeForCausalLM", _moe_decoder),
}

# architectures vLLM 0.32 serves through its Transformers backend (`TransformersForCausalLM`): the
# module tree is Hugging Face's with vLLM's attention swapped in; not described here yet
TRANSFORMERS_BACKEND = ("GPTNeoXForCausalLM", "Olmo2ForCausalLM")


def table(architecture: str, config) -> Arch:
    """The point table of a vLLM model of Hugging Face `architecture`, without the points vLLM's
    kernels do not expose (REFUSED)."""
    if architecture not in FAMILIES:
        why = (
            "vLLM 0.32 runs it through its Transformers backend, whose module tree hookscope's vLLM "
            "tables do not describe yet"
            if architecture in TRANSFORMERS_BACKEND
            else "no vLLM point table for it"
        )
        raise EngineError(
            f"{architecture}: {why}; supported on vLLM: {', '.join(FAMILIES)}. Load the checkpoint with "
            "hs.load(path) (Hugging Face) to read its points"
        )
    arch = FAMILIES[architecture][1](config)
    for name in [n for n in arch.specs if n.endswith(".attn.pattern")]:
        del arch.specs[name]  # build() adds it for Hugging Face attention; vLLM's never returns it
    arch.family = f"vllm:{arch.family}"
    return arch


def is_moe(arch: Arch) -> bool:
    """Whether the table is a mixture-of-experts family's (`moe_like`)."""
    return arch.family.removeprefix("vllm:") in moe.MODEL_TYPES


def refusal(arch: Arch, point: str) -> str | None:
    """Why vLLM never gives `point` (a canonical name) on this table's model; None where the table
    has it or nothing says why not."""
    if point in arch.specs:
        return None
    suffix = point.split(".", 2)[-1] if layer_of(point) is not None else point
    if suffix in REFUSED:
        return REFUSED[suffix]
    if is_moe(arch):
        return MOE_REFUSED.get(re.sub(r"^mlp\.experts\.\d+\.", "mlp.experts.{E}.", suffix))
    return None


def refuse_unexposed(arch: Arch, name: str, what: str) -> None:
    """An UnknownPointError saying why, for a point vLLM never gives (`what`: "readable" or
    "written"); nothing for a glob or a point the table has or lacks without a reason."""
    point = canonical(name)
    why = None if is_pattern(point) else refusal(arch, point)
    if why:
        raise UnknownPointError(f"{name!r} is not {what} on vLLM: {why}")


def model_class(architecture: str) -> str:
    """The vLLM class name this table describes."""
    return FAMILIES[architecture][0]
