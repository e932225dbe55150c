"""TransformerLens 4.x `TransformerBridge`: a Hugging Face model wrapped in HookPoints.

The bridge registers each HookPoint under its component path (`blocks.0.attn.q.hook_out`) and
lists TransformerLens 3 spellings beside it as aliases (`blocks.0.attn.hook_q`). So one HookPoint
has several spellings, and two different HookPoints can fold to one canonical name (on Gemma 2,
`blocks.0.hook_attn_out`, after the post-attention norm, and `blocks.0.attn.hook_out`, before it).
Here every HookPoint is one point, named by its TransformerLens spelling where it has one
(`blocks.0.attn.q`, `blocks.0.resid_pre`, and the sublayers' inputs `blocks.0.attn.in` /
`blocks.0.mlp.in` from `attn.hook_in` / `mlp.hook_in`), else by the bridge's own spelling,
unchanged (`blocks.0.attn.hook_out`). Every spelling the bridge accepts, and every folding of one
that names a single HookPoint, is an alias of that point. A folding two HookPoints claim belongs to
the TransformerLens spelling. (`blocks.0.hook_mlp_in`, TransformerLens's copy of the residual
before ln2, folds to `blocks.0.mlp.in_pre_norm`: `mlp.in` is what the MLP reads, after ln2.)

Some HookPoints carry a `hook_conversion` (per-head points: the HookPoint sees
`[batch, pos, d_model]`, the bridge's own hooks and `run_with_cache` see
`[batch, pos, head, d_head]`). The point's view applies that same conversion, and its inverse
on the way back, so captures, selections by head and edits see what TransformerLens shows.

What fires depends on the architecture (GPT-2's joint `attn.qkv` HookPoints, Llama's
`attn.hook_hidden_states` and GPT-NeoX's `attn.hook_rot_q` never do) and on bridge options
(`use_attn_result`, ...). So the table is built from one probe forward pass (1 x 4 tokens, under
inference_mode), which also gives the true execution order and shapes. Points that did not fire
are optional: naming one says which option switches it on, or that nothing does. (Hooks already on
the bridge when its table is first built see that one 1 x 4 pass too.)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..names import canonical, layer_of
from .base import Arch, OptionalPoint, PointSpec, View
from .transformer_lens import _rank as rank

# HookPoints gated by a bridge option: (last part of the HookPoint's path, the config flag,
# what switches it on)
_OPTIONS = (
    ("hook_result", "use_attn_result", "bridge.set_use_attn_result(True)"),
    ("hook_q_input", "use_split_qkv_input", "bridge.set_use_split_qkv_input(True)"),
    ("hook_k_input", "use_split_qkv_input", "bridge.set_use_split_qkv_input(True)"),
    ("hook_v_input", "use_split_qkv_input", "bridge.set_use_split_qkv_input(True)"),
    ("hook_attn_in", "use_attn_in", "bridge.set_use_attn_in(True)"),
    ("hook_mlp_in", "use_hook_mlp_in", "bridge.set_use_hook_mlp_in(True)"),
)
# [batch, head, query_pos, key_pos] points
_PATTERN_LIKE = ("attn.attn_scores", "attn.pattern")
_PER_HEAD = (
    "attn.q",
    "attn.k",
    "attn.v",
    "attn.z",
    "attn.result",
    "attn.rot_q",
    "attn.rot_k",
    "attn.q_input",
    "attn.k_input",
    "attn.v_input",
    "attn.in_pre_norm",
)


# points whose meaning differs between hookscope releases: name suffix -> (what it means in this
# release, what it meant in earlier ones), recorded in a store (see arch/llama.py)
MEANING_CHANGES = {
    "mlp.in": (
        "what the MLP reads, after ln2 (the bridge's mlp.hook_in)",
        "TransformerLens's hook_mlp_in, the residual stream before ln2 (now mlp.in_pre_norm)",
    ),
    "attn.in": (
        "what attention reads, after ln1 (the bridge's attn.hook_in)",
        "TransformerLens's hook_attn_in, the residual stream before ln1 (now attn.in_pre_norm)",
    ),
    "ln_final": (
        "the final norm's output, what the unembedding reads (the bridge's ln_final.hook_out)",
        "the bridge's ln_final.hook_normalized, before the norm's weight (now ln_final.normalized)",
    ),
}


def is_bridge(model: nn.Module) -> bool:
    return any(cls.__name__ == "TransformerBridge" for cls in type(model).__mro__)


# component inputs that are TransformerLens points: what attention / the MLP read (after ln1 / ln2)
_SUBLAYER_INPUTS = (".attn.hook_in", ".mlp.hook_in")
# the final norm's output, what the unembedding reads: `ln_final` (its hook_normalized, before the
# weight, is `ln_final.normalized`, as ln1 / ln2's are)
_FINAL_NORM_OUT = "ln_final.hook_out"


def _tl_style(key: str) -> bool:
    """A TransformerLens 3 spelling (`hook_resid_pre`, `attn.hook_q`), a sublayer's input
    (`attn.hook_in`: `attn.in`) or the final norm's output (`ln_final`), not another component's
    own input / output (`attn.q.hook_out`)."""
    last = key.rsplit(".", 1)[-1]
    return (
        (last.startswith("hook_") and last not in ("hook_in", "hook_out"))
        or key.endswith(_SUBLAYER_INPUTS)
        or key == _FINAL_NORM_OUT
    )


def _view(hook_point: nn.Module) -> View | None:
    """The bridge's own conversion of what its hooks see, and its inverse for edits."""
    conversion = getattr(hook_point, "hook_conversion", None)
    if conversion is None:
        return None

    def put(raw: Tensor, new: Tensor) -> Tensor:
        return conversion.revert(new).to(raw.dtype)

    get = conversion.convert
    if type(conversion).__name__ == "AttentionAutoConversion":
        # it changes only 4-d tensors, yet records every tensor it sees in a dict that nothing in
        # TransformerLens 4.3 empties: skip the call where it would return its input unchanged
        get = lambda raw: conversion.convert(raw) if raw.dim() == 4 else raw
    return View(get=get, put=put, label=f"bridge {type(conversion).__name__}")


def _dims(name: str, shape: tuple[int, ...] | None) -> tuple[int | None, int | None]:
    """(position dim, head dim) of a point as the bridge shows it: [batch, head, query, key] for
    scores and patterns, [batch, pos, head, d] for any other 4-d point (the bridge's conversions
    give TransformerLens's per-head layout)."""
    suffix = name.split(".", 2)[2] if layer_of(name) is not None else name
    if suffix in _PATTERN_LIKE:
        return 2, 1
    if shape is None:  # never fired: go by the name
        return 1, (2 if suffix in _PER_HEAD else None)
    if len(shape) < 2:
        return None, None
    return 1, (2 if len(shape) == 4 else None)


def _gate(key: str) -> tuple[str, str] | None:
    last = key.rsplit(".", 1)[-1]
    return next(((flag, needs) for part, flag, needs in _OPTIONS if part == last), None)


def _probe(model: nn.Module, hook_points: dict[int, nn.Module]) -> dict[int, tuple[int, tuple]] | None:
    """Which HookPoints fire in a plain forward pass: id -> (order of first firing, shape as the
    bridge's hooks see it). None when the probe cannot run (no token input, weights on meta)."""
    fired: dict[int, tuple[int, tuple]] = {}

    def record(module: nn.Module, args: tuple, output: object) -> None:
        if id(module) not in fired:
            conversion = getattr(module, "hook_conversion", None)
            value = conversion.convert(output) if conversion is not None else output
            fired[id(module)] = (len(fired), tuple(value.shape) if isinstance(value, Tensor) else ())

    handles = [hp.register_forward_hook(record) for hp in hook_points.values()]
    try:
        device = next(model.parameters()).device
        if device.type == "meta":
            return None
        with torch.inference_mode():
            model(torch.zeros(1, 4, dtype=torch.long, device=device))
    except Exception:  # an encoder-decoder or vision bridge wants other inputs: list everything
        return None
    finally:
        for handle in handles:
            handle.remove()
    return fired


def table(model: nn.Module) -> Arch:
    keys: dict[int, list[str]] = {}
    hook_points: dict[int, nn.Module] = {}
    for key, hook_point in model.hook_dict.items():
        hook_points[id(hook_point)] = hook_point
        keys.setdefault(id(hook_point), []).append(key)
    primary, aliases = _names(hook_points, keys)
    fired = _probe(model, hook_points)

    cfg = model.cfg
    modules: dict[str, nn.Module] = {}
    listed: list[tuple[tuple, PointSpec]] = []
    optional: dict[str, OptionalPoint] = {}
    for hp_id, name in primary.items():
        modules[name] = hook_points[hp_id]
        order, shape = fired.get(hp_id, (None, None)) if fired is not None else (None, None)
        pos_dim, head_dim = _dims(name, shape)
        spec = PointSpec(
            name=name,
            module=name,
            io="output",
            view=_view(hook_points[hp_id]),
            layer=layer_of(name),
            pos_dim=pos_dim,
            head_dim=head_dim,
        )
        gate = next((g for g in map(_gate, keys[hp_id]) if g is not None), None)
        if order is not None or (fired is None and (gate is None or getattr(cfg, gate[0], False))):
            listed.append(((0, order) if order is not None else (1, rank(name)), spec))
        elif gate is not None:
            flag, needs = gate
            optional[name] = OptionalPoint(spec, needs, lambda flag=flag: bool(getattr(cfg, flag, False)))
        else:
            optional[name] = OptionalPoint(
                spec,
                "",
                lambda: False,
                why=f"{name!r} never fires in a forward pass of this bridge (TransformerLens has the "
                f"HookPoint, this architecture does not call it); hook the module that computes it "
                f"as module:<path>:output",
            )
    specs = [spec for _, spec in sorted(listed, key=lambda item: item[0])]
    specs.append(PointSpec(name="logits", module="", io="output"))
    return Arch(
        "tl_bridge",
        {s.name: s for s in specs},
        [f"blocks.{i}" for i in range(cfg.n_layers)],
        n_heads=cfg.n_heads,
        d_model=cfg.d_model,
        modules=modules,
        aliases=aliases,
        optional=optional,
    )


def _names(hook_points: dict[int, nn.Module], keys: dict[int, list[str]]) -> tuple[dict[int, str], dict]:
    """Each HookPoint's point name, and every spelling -> point name (see the module docstring)."""
    claims: dict[str, dict[int, tuple]] = {}  # folded name -> HookPoint -> its best claim
    for hp_id, spellings in keys.items():
        registry = getattr(hook_points[hp_id], "name", None)
        for key in spellings:
            claim = (0 if _tl_style(key) else 1, 0 if key != registry else 1)
            mine = claims.setdefault(canonical(key), {})
            mine[hp_id] = min(mine.get(hp_id, claim), claim)
    winner: dict[str, int] = {}
    for name, claimants in claims.items():
        ranked = sorted(claimants.items(), key=lambda c: c[1])
        if len(ranked) == 1 or ranked[0][1] < ranked[1][1]:  # a tie: neither gets the folded name
            winner[name] = ranked[0][0]
    primary: dict[int, str] = {}
    for hp_id, spellings in keys.items():
        won = sorted(
            (claims[canonical(k)][hp_id], canonical(k))
            for k in spellings
            if winner.get(canonical(k)) == hp_id and _tl_style(k)
        )
        primary[hp_id] = won[0][1] if won else (getattr(hook_points[hp_id], "name", None) or spellings[0])
    aliases = {key: primary[hp_id] for hp_id, spellings in keys.items() for key in spellings}
    for name, hp_id in winner.items():
        aliases.setdefault(name, primary[hp_id])
    return primary, aliases


def optional_points(arch: Arch) -> dict[str, str]:
    """Points of a bridge's table (`arch_of(bridge)`) that a plain forward does not fire -> the
    call that switches each on ("" where nothing does)."""
    return {name: point.needs for name, point in arch.optional.items()}
