"""Point names: parse, normalise, match patterns, suggest close names on a typo.

Canonical names follow TransformerLens (`blocks.6.resid_post`, `blocks.6.attn.z`, `embed`), and
TransformerLens's own spellings are accepted as aliases (`blocks.6.hook_resid_post`,
`blocks.6.hook_attn_out`, `ln_final.hook_normalized` for `ln_final.normalized`). Any module of any
model is reachable as `module:<dotted.path>:input` or `module:<dotted.path>:output`.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

MODULE_PREFIX = "module:"

# TransformerLens spellings whose canonical name is not just "drop the hook_ prefix". `attn.in` /
# `mlp.in` are what attention / the MLP read, after ln1 / ln2 (the bridge's `attn.hook_in` /
# `mlp.hook_in`); TransformerLens's `hook_attn_in` / `hook_mlp_in` are the residual stream before
# that norm (copies that exist only behind use_attn_in / use_hook_mlp_in), so they fold apart.
_TL_RENAMES = {
    "hook_attn_out": "attn.out",
    "hook_mlp_out": "mlp.out",
    "hook_attn_in": "attn.in_pre_norm",
    "hook_mlp_in": "mlp.in_pre_norm",
    "hook_q_input": "attn.q_input",
    "hook_k_input": "attn.k_input",
    "hook_v_input": "attn.v_input",
}
_LAYER = re.compile(r"^blocks\.(\d+)\.")

# What each canonical name means: TransformerLens's meaning, on every family that has the point
# (`hookscope points` shows it; README "Point names" has the table and where families differ)
MEANINGS = {
    "embed": "token embeddings",
    "pos_embed": "position embeddings",
    "patch_embed": "patch embeddings",
    "resid_pre": "residual stream into the block",
    "ln1.scale": "ln1's scale, sqrt(mean square + eps)",
    "ln2.scale": "ln2's scale, sqrt(mean square + eps)",
    "ln1.normalized": "ln1's input / scale, before its weight",
    "ln2.normalized": "ln2's input / scale, before its weight",
    "attn.in": "what attention reads (after ln1)",
    "attn.q": "queries, per head",
    "attn.k": "keys, per head",
    "attn.v": "values, per head",
    "attn.pattern": "attention weights [batch, head, query, key]",
    "attn.z": "attention output per head, before W_O",
    "attn.out_pre_norm": "attention output before its post-norm",
    "attn.out_pre_scale": "attention output before LayerScale (DINOv2)",
    "attn.out": "what attention adds to the residual stream",
    "attn.in_pre_norm": "residual stream before ln1 (TL hook_attn_in)",
    "resid_mid": "residual stream between attention and MLP",
    "mlp.in_pre_norm": "residual stream before ln2 (TL hook_mlp_in)",
    "mlp.in": "what the MLP reads (after ln2): a transcoder's input",
    "mlp.pre": "MLP pre-activation (the gate, if gated)",
    "mlp.pre_linear": "gated MLP's up projection",
    "mlp.post": "MLP activation, into W_out",
    "mlp.out_pre_norm": "MLP output before its post-norm",
    "mlp.out_pre_scale": "MLP output before LayerScale (DINOv2)",
    "mlp.out": "what the MLP adds to the residual stream",
    "resid_post": "residual stream out of the block",
    "ln_final.scale": "final norm's scale, sqrt(mean square + eps)",
    "ln_final.normalized": "final norm's input / scale, before its weight",
    "ln_final": "final norm's output, what the unembedding reads",
    "logits": "the model's output logits",
}


def meaning(name: str) -> str:
    """What a canonical point name means ("" where the table has no entry: family-specific points)."""
    return MEANINGS.get(_LAYER.sub("", name), "")


@dataclass(frozen=True)
class ModulePath:
    """A raw `module:<path>:input|output` point."""

    path: str
    io: str  # "input" or "output"


def canonical(name: str) -> str:
    """The canonical spelling of a point name (aliases folded, whitespace stripped)."""
    name = name.strip()
    if name.startswith(MODULE_PREFIX):
        mp = parse_module_path(name)
        return f"{MODULE_PREFIX}{mp.path}:{mp.io}"
    if name == "ln_final.hook_out":  # the bridge's final norm output: what the unembedding reads
        return "ln_final"
    parts = name.split(".")
    last = parts[-1]
    if last in _TL_RENAMES:
        renamed = _TL_RENAMES[last].split(".")
        if len(parts) > 1 and parts[-2] == renamed[0]:  # the bridge's `attn.hook_q_input`: one `attn`
            renamed = renamed[1:]
        return ".".join(parts[:-1] + renamed)
    if last.startswith("hook_"):
        parts[-1] = last[len("hook_") :]
    name = ".".join(parts)
    return canonical(name) if name.startswith(MODULE_PREFIX) else name  # "hook_module:..." checked as one


def parse_module_path(name: str) -> ModulePath:
    """Parse `module:<path>[:input|:output]` (output when the suffix is left out)."""
    from .errors import UnknownPointError

    body = name[len(MODULE_PREFIX) :]
    path, _, io = body.partition(":")
    io = io or "output"
    if io not in ("input", "output") or not path:
        raise UnknownPointError(
            f"bad raw module point {name!r}: write module:<dotted.module.path>:input or :output"
        )
    return ModulePath(path, io)


def layer_of(name: str) -> int | None:
    """The block index of a canonical per-layer name, else None."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def is_pattern(name: str) -> bool:
    return any(ch in name for ch in "*?[")


def expand(
    patterns: str | list[str] | tuple[str, ...],
    known: list[str],
    aliases: Mapping[str, str] | None = None,
    explicit: Collection[str] = (),
) -> list[str]:
    """Resolve names and glob patterns (`blocks.*.resid_post`) against the known names.

    Order follows `known` (the model's execution order) for patterns, and the caller's order
    for plain names. Unknown names raise an error that lists the closest real ones.

    `aliases`: a model's own spellings -> its canonical names, looked up before the generic
    folding of `canonical()` (a TransformerLens bridge has several HookPoints whose spellings fold
    to one name, e.g. `blocks.0.hook_mlp_in` and `blocks.0.mlp.hook_in`); a pattern written in
    those spellings matches through them. `explicit`: names valid when named, never matched by a
    pattern (points that fire only with a model option switched on).
    """
    from .errors import UnknownPointError

    if isinstance(patterns, str):
        patterns = [p for p in patterns.split(",") if p.strip()] if "," in patterns else [patterns]
    aliases = aliases or {}
    known_set = set(known)
    out: list[str] = []
    for raw in patterns:
        name = aliases.get(raw.strip()) or canonical(raw)
        if name.startswith(MODULE_PREFIX):
            out.append(name)
        elif is_pattern(name):
            hits = [k for k in known if fnmatch.fnmatchcase(k, name)]
            if not hits and aliases:  # written in the model's own spelling
                via = {aliases[a] for a in aliases if fnmatch.fnmatchcase(a, raw.strip())}
                hits = [k for k in known if k in via]
            if not hits:
                raise UnknownPointError(f"pattern {raw!r} matches no point{_hint(name, known)}")
            out.extend(hits)
        elif name in known_set or name in explicit:
            out.append(name)
        else:
            raise UnknownPointError(f"unknown point {raw!r}{_hint(name, known)}")
    seen: set[str] = set()
    return [n for n in out if not (n in seen or seen.add(n))]


def suggest(name: str, known: list[str], n: int = 5) -> list[str]:
    """The closest real names to a misspelt one."""
    close = difflib.get_close_matches(name, known, n=n, cutoff=0.6)
    if not close:  # a wrong layer index reads as far from every name: match the shape instead
        generic = _LAYER.sub("blocks.{L}.", name)
        close = [k for k in known if _LAYER.sub("blocks.{L}.", k) == generic][:n]
    return close


def _hint(name: str, known: list[str]) -> str:
    close = suggest(name, known)
    layers = sorted({layer_of(k) for k in known if layer_of(k) is not None})
    tail = f" (the model has blocks 0-{layers[-1]})" if layers else ""
    if close:
        return f"; closest: {', '.join(close)}{tail}. `hookscope points MODEL` lists them all"
    return f"{tail}; `hookscope points MODEL` lists every point, or use module:<path>:output"


def find_key(keys: Iterable[str], name: str, point_of: Callable[[str], str | None] = canonical) -> str | None:
    """The key among `keys` that names the same point as `name`: `name` itself if it is one, else
    the first key whose point (`point_of`: `canonical`, or a model table's own lookup, which knows
    spellings `canonical` cannot fold) is `name`'s; None if there is none. The one alias lookup of
    every name-keyed result (`PointDict`, `patch`'s source)."""
    keys = list(keys)
    if name in keys:
        return name
    point = point_of(name)
    if point is None:
        return None
    return next((key for key in keys if point_of(key) == point), None)
