"""What a point is: a module, which side of it (input / output), and a view onto its tensor.

A family file (gpt2.py, llama.py, ...) is a table: canonical name -> (module path, io, view).
Views are pairs of pure functions: `get` reads the canonical tensor out of the module's raw
tensor (e.g. one of GPT-2's fused q/k/v thirds, split into heads), `put` builds a new raw
tensor with the canonical part replaced, so edits and gradients flow through the same names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ..errors import HookscopeError, UnknownPointError
from ..names import MODULE_PREFIX, expand, parse_module_path


@dataclass(frozen=True)
class View:
    get: Callable[[Tensor], Tensor]
    put: Callable[[Tensor, Tensor], Tensor]
    label: str
    head_dim: int | None = None  # set when the view splits heads out
    # the same view on a contiguous 1/n of the raw tensor's last dim (a tensor-parallel rank's
    # columns of a column-parallel projection), given n; None where a slice has no such meaning
    split: Callable[[int], View] | None = field(default=None, compare=False)
    # True where `get` costs per row it reads (a collective across processes), reads each row
    # (batch, position) alone along the trailing dims and returns memory of its own: a capture then
    # takes its positions / tokens from the raw tensor before `get`, so only those rows pay for it
    select_rows_first: bool = field(default=False, compare=False)


def heads(n_heads: int) -> View:
    """[..., n_heads * d_head] <-> [..., n_heads, d_head]."""
    return View(
        get=lambda raw: raw.unflatten(-1, (n_heads, -1)),
        put=lambda raw, new: new.flatten(-2),
        label=f"split into {n_heads} heads",
        head_dim=-2,
        split=lambda n: heads(n_heads // n),
    )


def fused_heads(part: int, n_parts: int, n_heads: int, interleaved: bool = False) -> View:
    """One of several projections fused in one Linear (GPT-2 c_attn, NeoX query_key_value).

    Concatenated layout (GPT-2): [q | k | v], each n_heads * d_head wide.
    Interleaved layout (NeoX): per head [q_h | k_h | v_h].
    """
    if interleaved:

        def get(raw: Tensor) -> Tensor:
            return raw.unflatten(-1, (n_heads, -1)).chunk(n_parts, dim=-1)[part]

        def put(raw: Tensor, new: Tensor) -> Tensor:
            parts = list(raw.unflatten(-1, (n_heads, -1)).chunk(n_parts, dim=-1))
            parts[part] = new.to(raw.dtype)
            return torch.cat(parts, dim=-1).flatten(-2)
    else:

        def get(raw: Tensor) -> Tensor:
            return raw.chunk(n_parts, dim=-1)[part].unflatten(-1, (n_heads, -1))

        def put(raw: Tensor, new: Tensor) -> Tensor:
            parts = list(raw.chunk(n_parts, dim=-1))
            parts[part] = new.to(raw.dtype).flatten(-2)
            return torch.cat(parts, dim=-1)

    # interleaved, a slice of whole heads is the same layout with fewer heads; concatenated, it is not
    split = (lambda n: fused_heads(part, n_parts, n_heads // n, interleaved=True)) if interleaved else None
    return View(get, put, f"part {part} of {n_parts} fused, {n_heads} heads", head_dim=-2, split=split)


class Call(NamedTuple):
    """A module call, for points whose view needs the module and all of its arguments (an
    expert's activations: the routed rows, the routing and the expert's weights). `put` returns
    a new Call; the hook passes its args and kwargs on."""

    module: nn.Module
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class PointSpec:
    """Where a canonical point lives in a model."""

    name: str
    module: str  # dotted path from the root model ("" is the root)
    io: str  # "output" (forward hook) or "input" (pre-forward hook)
    view: View | None = None  # None: the raw tensor is the activation
    # which element when the module returns a tuple (attention: (out, weights)); None: the view
    # reads the whole output (io="output") or the whole call, as a `Call` (io="input")
    item: int | None = 0
    pos_dim: int | None = 1  # which dim is the token position (None: no position dim)
    head_dim: int | None = None  # which dim is the head, for per-head points
    layer: int | None = None
    # attention weights of Hugging Face models: only computed by eager attention, and returned
    # after use, so they can be read (the model switches to eager while hooked) but not edited
    needs_eager: bool = False
    # where a write lands when the model reads the point back from two places (see `SumOf`); None:
    # a hook at `module` / `io` writes it
    written_as: SumOf | None = None
    # `module` split at the dots, once: attaching a hook walks it (see `Arch.module`)
    steps: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", tuple(self.module.split(".")) if self.module else ())

    def require_writable(self, what: str) -> None:
        """Refuse edits / gradients on a point whose value the model never reads back."""
        if self.needs_eager:
            raise HookscopeError(
                f"{what} on {self.name}: Hugging Face attention returns its weights after using them, so "
                "changing them changes nothing; edit attn.q / attn.k / attn.z instead "
                "(or use a TransformerLens model)"
            )


@dataclass(frozen=True)
class SumOf:
    """A point that is the sum of a stream and what a sublayer adds to it, read where it enters
    the next sublayer (resid_mid at ln2's input) while the block keeps its own reference for the
    skip connection: written there, an edit would reach only the next sublayer. Hooks write it at
    `added`'s output instead, as `new - skip`, so the stream both branches read carries the edit.
    `skip` is read by the first pre-hook of the module that first reads the stream (ln1): the
    stream as the block keeps it, after any edit of resid_pre."""

    skip: PointSpec
    added: PointSpec


# the model itself, called: a pre-forward hook here sees each call's arguments (its attention mask)
ROOT = PointSpec(name="<root>", module="", io="input")


@dataclass(frozen=True)
class OptionalPoint:
    """A point that fires only with a model option switched on (a TransformerLens bridge's
    `use_attn_result`, ...): valid when named, left out of listings and patterns."""

    spec: PointSpec
    needs: str  # what to call, e.g. "bridge.set_use_attn_result(True)"; "" when nothing does
    active: Callable[[], bool]  # whether the option is on now
    why: str = ""  # the error when named while inactive (default: says to call `needs`)


@dataclass
class Arch:
    """A model's hook points, in execution order."""

    family: str
    specs: dict[str, PointSpec]
    block_paths: list[str] = field(default_factory=list)
    n_heads: int | None = None
    d_model: int | None = None
    # TransformerLens models are addressed through their own hook_dict (aliases included)
    modules: dict[str, nn.Module] | None = None
    # the model's own spellings -> canonical names, before the generic folding of names.canonical
    aliases: dict[str, str] = field(default_factory=dict)
    optional: dict[str, OptionalPoint] = field(default_factory=dict)
    # set by a `points=` load (`partial.PartialLoad`): refuses a hook on a point past its weights
    loaded: Any = None

    @property
    def names(self) -> list[str]:
        return list(self.specs)

    @property
    def n_layers(self) -> int:
        return len(self.block_paths)

    def resolve(self, names: str | list[str] | tuple[str, ...]) -> list[PointSpec]:
        """Specs for names / patterns / raw module paths; unknown names raise with suggestions."""
        return [self.spec(n) for n in expand(names, self.names, self.aliases, self.optional)]

    def spec(self, name: str) -> PointSpec:
        found = self.specs.get(name)  # the common case first: one dict lookup (attach time counts)
        if found is not None:
            return found
        if name.startswith(MODULE_PREFIX):
            mp = parse_module_path(name)
            return PointSpec(name=f"{MODULE_PREFIX}{mp.path}:{mp.io}", module=mp.path, io=mp.io, pos_dim=None)
        try:
            return self.specs[name]
        except KeyError:
            if name in self.optional:
                return self._optional(name)
            # raises UnknownPointError with suggestions
            resolved = expand([name], self.names, self.aliases, self.optional)
            if len(resolved) != 1:  # a glob: hooks and specs take one point each
                raise UnknownPointError(
                    f"{name!r} matches {len(resolved)} points ({', '.join(resolved[:3])}, ...); name one "
                    "point here, or resolve the pattern with arch.resolve()"
                ) from None
            return self.spec(resolved[0])  # canonical now: a known name, or a raw module path

    def _optional(self, name: str) -> PointSpec:
        point = self.optional[name]
        if not point.active():
            raise UnknownPointError(
                point.why
                or (f"{name!r} fires only with a model option switched on: call {point.needs} first")
            )
        return point.spec

    def module(self, model: nn.Module, spec: PointSpec) -> nn.Module:
        if self.loaded is not None:  # every hook finds its module here: the one check
            self.loaded.check(spec)
        path = spec.module
        if self.modules is not None and path in self.modules:
            return self.modules[path]
        # the registered-submodule walk: plain dict lookups, about 10x cheaper than get_submodule's
        # getattr per step, and never stale (a replaced submodule is found as it is now)
        module = model
        try:
            for step in spec.steps:
                module = module._modules[step]
            if module is not None:
                return module
        except (KeyError, AttributeError):
            pass
        try:
            return model.get_submodule(spec.module)
        except AttributeError:
            raise UnknownPointError(
                f"point {spec.name!r}: the model has no module {spec.module!r}"
                " (print(model) shows the module tree)"
            ) from None


Entry = tuple[str, str, View | None] | tuple[str, str, View | None, dict]


def sum_of(skip: str, added: str) -> dict:
    """Table options of a point equal to the stream entering module `skip` plus the point
    `added` (a name of the same block, listed before it): written as that sum (`SumOf`)."""
    return {"sum_of": (skip, added)}


def build(
    family: str,
    prefix: str,
    n_layers: int,
    block: str,
    top: dict[str, Entry],
    per_layer: dict[str, Entry],
    final: dict[str, Entry],
    n_heads: int | None,
    d_model: int | None,
) -> Arch:
    """Expand a family's table into specs for every layer, in execution order.

    Module paths in the table are relative to the base model (`prefix`), except those starting
    with "/", which are relative to the root (the LM head lives beside the base model).
    Every family with an attention module also gets `attn.pattern` ([batch, head, query, key]).
    """
    if "attn.out" in per_layer and "attn.pattern" not in per_layer:
        attn_module = per_layer["attn.q"][0].rsplit(".", 1)[0]
        pattern = (attn_module, "output", None, {"item": 1, "pos_dim": 2, "head_dim": 1, "needs_eager": True})
        items = list(per_layer.items())
        at = [k for k, _ in items].index("attn.z")
        per_layer = dict(items[:at] + [("attn.pattern", pattern)] + items[at:])

    specs: dict[str, PointSpec] = {}

    def module_path(path: str, layer: int | None) -> str:
        path = path.replace("{L}", str(layer))
        return (path[1:] if path.startswith("/") else prefix + path).rstrip(".")

    def spec(name: str, entry: Entry, layer: int | None) -> PointSpec:
        path, io, view, *extra = entry
        opts = {"head_dim": view.head_dim if view else None, **(extra[0] if extra else {})}
        if "sum_of" in opts:
            skip, added = opts.pop("sum_of")
            skip_spec = PointSpec(name=f"{name} (skip)", module=module_path(skip, layer), io="input")
            opts["written_as"] = SumOf(skip_spec, specs[f"blocks.{layer}.{added}"])
        return PointSpec(name=name, module=module_path(path, layer), io=io, view=view, layer=layer, **opts)

    for name, entry in top.items():
        specs[name] = spec(name, entry, None)
    for layer in range(n_layers):
        for suffix, entry in per_layer.items():
            name = f"blocks.{layer}.{suffix}"
            specs[name] = spec(name, entry, layer)
    for name, entry in final.items():
        specs[name] = spec(name, entry, None)
    blocks = [prefix + block.replace("{L}", str(i)) for i in range(n_layers)]
    return Arch(family, specs, blocks, n_heads=n_heads, d_model=d_model)
