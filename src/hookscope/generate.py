"""Captures and edits while a model generates, aligned to token positions.

    gen = hs.generate(model, inputs, points="blocks.1.resid_post", max_new_tokens=8)
    gen.sequences                       # [batch, T]: the prompt (left-padded) and the new tokens
    gen["blocks.1.resid_post"]          # [batch, T, d]: entry [b, p] was computed for sequences[b, p]
    gen.mask                            # [batch, T]: False on padding and after a row's EOS

With the KV cache on, `generate` runs the model once on the whole prompt and then once per new
token on that token alone. A point's hook therefore sees chunks of positions, [0, P) first and
then [P + k, P + k + 1); `_Steps` knows which positions each forward pass covers, and each point's
`_Kept` files the chunk at those positions (only the ones the `positions=` selection can still
need, so memory is bounded by what is kept). `generate` never runs the model on the token it
samples last; one more cached step on that token (`_final_step`) completes the sequence.

Heads, dtype and device selections are those of `hs.capture`, which does the hooking (so the
compile policy and early-copy rules are the capture's own); positions are sequence positions
(0 is the first prompt column, -1 the last generated one) with `hs.collect`'s shapes: an int or
"last" drops the position dim, a slice or list keeps it, a [batch] tensor picks one per row.

Edits (`hs.steer`, `hs.ablate`, `hs.patch`) apply to the prompt, the generated tokens or both
(`edit_on=`); an edit's own `positions=` are sequence positions too, and a patch's source is
read at the positions the current step covers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .arch import PointSpec, arch_of
from .arch.tl_bridge import is_bridge
from .capture import capture
from .errors import HookscopeError, SelectionError
from .hooks import Hook, hooks
from .names import canonical
from .selection import Heads, Positions, Selection

EDIT_ON = ("prompt", "generated", "both")

# decoding modes whose forward passes do not map one-to-one onto sequence positions
_UNSUPPORTED = {
    "num_beams": "beam search reorders and drops rows between steps",
    "assistant_model": "assisted decoding runs and then rejects draft tokens",
    "prompt_lookup_num_tokens": "prompt-lookup decoding runs and then rejects draft tokens",
    "num_assistant_tokens": "assisted decoding runs and then rejects draft tokens",
    "penalty_alpha": "contrastive search runs candidate tokens it then drops",
}


@dataclass
class Generation(Mapping[str, Tensor]):
    """What `hs.generate` returns. Reads like a dict of activations, one per point."""

    sequences: Tensor  # [batch, T] token ids: prompt (as given, left padding included) + new tokens
    mask: Tensor  # [batch, T] bool: True where sequences holds a real token (not padding, not after EOS)
    prompt_length: int  # P: columns [0, P) are the prompt, [P, T) were generated
    activations: dict[str, Tensor] = field(default_factory=dict)
    output: Any = None  # what the model's own generate returned (scores, etc., when asked for)

    @property
    def new_tokens(self) -> Tensor:
        return self.sequences[:, self.prompt_length:]

    def text(self, tokenizer: Any, *, prompt: bool = False) -> list[str]:
        """Each row's generated text (with `prompt=True`, the prompt too), real tokens only."""
        start = 0 if prompt else self.prompt_length
        return [tokenizer.decode(row[keep[start:]].tolist(), skip_special_tokens=True)
                for row, keep in zip(self.sequences[:, start:], self.mask, strict=True)]

    def __getitem__(self, name: str) -> Tensor:
        if name in self.activations:
            return self.activations[name]
        for key, value in self.activations.items():
            if canonical(key) == canonical(name):
                return value
        raise KeyError(f"{name!r} was not captured; captured: {list(self.activations)}")

    def __iter__(self) -> Iterator[str]:
        return iter(self.activations)

    def __len__(self) -> int:
        return len(self.activations)


def generate(
    model: nn.Module,
    inputs: Any,
    points: str | Sequence[str] = (),
    *,
    edits: Sequence[Any] = (),
    edit_on: str = "both",
    positions: Positions = None,
    heads: Heads = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    **generate_kwargs: Any,
) -> Generation:
    """Generate with `model.generate(**generate_kwargs)`, capturing `points` and applying `edits`
    (from `hs.steer` / `hs.ablate` / `hs.patch`) at every step.

    `model`: a Hugging Face causal LM, a TransformerLens 3 `HookedTransformer` (its own generate;
    a padded batch needs its tokenizer's pad id) or a TransformerLens 4 `TransformerBridge`.
    `inputs`: input ids [batch, P], or a tokenizer's output (a mapping with `input_ids` and
    `attention_mask`; pad on the left for a batch of different lengths). `edit_on`: "prompt",
    "generated" or "both". `positions` / `heads` / `dtype` / `device`: as in `hs.collect`, with
    positions counted over the whole final sequence. Activations at padding and after a row's EOS
    are kept as computed; `Generation.mask` says which positions hold real tokens.
    """
    if edit_on not in EDIT_ON:
        raise SelectionError(f"edit_on={edit_on!r}: use one of {', '.join(EDIT_ON)}")
    for key, why in _UNSUPPORTED.items():
        value = generate_kwargs.get(key)
        if value is not None and not (key == "num_beams" and value == 1) and value is not False:
            raise HookscopeError(f"hs.generate does not support {key}={value!r}: {why}, so captures and "
                                 "edits cannot follow token positions; use greedy or sampling decoding")
    config = generate_kwargs.get("generation_config") or getattr(model, "generation_config", None)
    beams = generate_kwargs.get("num_beams") or getattr(config, "num_beams", None) or 1
    if beams > 1:
        raise HookscopeError(f"hs.generate does not support num_beams={beams} (from the arguments or the "
                             f"generation config): {_UNSUPPORTED['num_beams']}; pass num_beams=1")
    if not hasattr(model, "generate"):
        raise HookscopeError(f"{type(model).__name__} has no generate(); hs.generate needs a Hugging Face "
                             "causal LM (AutoModelForCausalLM)")
    # "lens": a TransformerLens 3 HookedTransformer (its generate embeds outside forward and calls
    # forward directly); "bridge": a TransformerLens 4 TransformerBridge (its generate calls the
    # bridge like a Hugging Face model's does, one pass per token, and takes an attention mask)
    bridge = is_bridge(model)
    lens = not bridge and _is_transformer_lens(model)
    input_ids, attention_mask, extra = _split_inputs(inputs)
    given_ids = input_ids
    if (lens or bridge) and attention_mask is not None and bool(attention_mask.all()):
        attention_mask = None  # what TransformerLens assumes anyway: its unpadded path, unchanged
    if lens and attention_mask is not None:
        # on token input, prepend_bos only tells TL whether a leading pad id is a BOS to keep
        generate_kwargs.setdefault("prepend_bos", False)
        input_ids = _lens_padded_prompt(model, input_ids, attention_mask,
                                        bool(generate_kwargs["prepend_bos"]))
    arch = arch_of(model)
    specs = arch.resolve(points) if points else []
    for spec in specs:
        _check_point(spec)
        if lens and not spec.module.startswith(_LENS_IN_FORWARD):
            raise SelectionError(f"{spec.name}: TransformerLens generate embeds tokens outside its forward "
                                 "passes, so this point cannot follow the steps; capture blocks.* / ln_final "
                                 "points (or run hs.collect over gen.sequences)")
    point_names = [s.name for s in specs]

    steps = _Steps(prompt_length=input_ids.shape[1])
    kept = {name: _Kept(positions) for name in point_names}
    for e in edits:
        if not callable(e) or not isinstance(getattr(e, "point", None), str):
            raise HookscopeError("edits= takes hs.steer / hs.ablate / hs.patch values, got "
                                 f"{type(e).__name__}")
    step_edits = [_StepEdit(e, edit_on, steps, arch.spec(e.point)) for e in edits]
    kwargs = {**extra, **generate_kwargs}
    if specs:
        kwargs["return_dict_in_generate"] = True  # its cache runs the last token (see _final_step)
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if lens or bridge:
        kwargs.pop("return_dict_in_generate", None)
        kwargs.setdefault("verbose", False)
    elif "logits" in point_names and "logits_to_keep" in _forward_parameters(type(model)):
        # generate computes the prompt's logits at its last position only; logits are asked for here
        kwargs.setdefault("logits_to_keep", 0)
    if lens and attention_mask is not None:
        kwargs.pop("attention_mask")  # HookedTransformer.generate reads the padding off the pad tokens
        kwargs["padding_side"] = "left"

    with contextlib.ExitStack() as stack:
        # edits first: a capture on an edited point then sees the value the model goes on with
        edit_hooks = stack.enter_context(hooks(model))
        for step_edit in step_edits:
            edit_hooks.forward(step_edit.spec, step_edit)
        cap = None
        if specs:
            cap = stack.enter_context(capture(model, point_names, heads=heads, dtype=dtype, device=device,
                                              stop=False))
        # registered after the capture's own root hooks, so the step's captures are filed when ours runs
        # TransformerLens generate calls model.forward, not model(): hook its first and last modules
        first, last = (model.blocks[0], model.unembed) if lens else (model, model)
        stack.enter_context(_root_hooks(first, last, steps, step_edits, cap, kept))
        output = model.generate(input_ids, **kwargs)
        sequences = output.sequences if hasattr(output, "sequences") else output
        if attention_mask is not None and sequences.shape[0] != attention_mask.shape[0]:
            # num_return_sequences: generate repeats each prompt row that many times
            repeats = sequences.shape[0] // attention_mask.shape[0]
            attention_mask = attention_mask.repeat_interleave(repeats, 0)
        if specs and steps.filled < sequences.shape[1]:
            if lens or bridge:  # no cache comes back: the whole sequence once more, its new position kept
                _full_pass(model, sequences, attention_mask)
            else:
                _final_step(model, output, sequences, attention_mask, extra)
    # made under the capture's inference_mode: a plain copy can feed a later pass with gradients
    sequences = sequences.clone()
    if given_ids is not input_ids:  # the prompt as given (its padding ids were swapped for generate)
        sequences[:, :given_ids.shape[1]] = given_ids.to(sequences.device)
    total = sequences.shape[1]
    if specs and steps.filled != total:
        raise HookscopeError(f"internal: captured {steps.filled} positions for a sequence of {total}; "
                             "this decoding mode does not run one forward pass per token")
    eos = _lens_eos_ids(model, generate_kwargs) if lens or bridge else _eos_ids(model, generate_kwargs)
    mask = _real_tokens(sequences, attention_mask, steps.prompt_length, eos)
    activations = {name: k.result(total, sequences.shape[0]) for name, k in kept.items()}
    return Generation(sequences, mask, steps.prompt_length, activations,
                      output if generate_kwargs.get("return_dict_in_generate") else None)


# --- inputs and outputs ------------------------------------------------------------------------


def _split_inputs(inputs: Any) -> tuple[Tensor, Tensor | None, dict]:
    if isinstance(inputs, Tensor):
        ids, mask, extra = inputs, None, {}
    elif isinstance(inputs, Mapping):
        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
        ids, mask = inputs.get("input_ids"), inputs.get("attention_mask")
        if "token_type_ids" in extra:
            extra.pop("token_type_ids")  # tokenizers add them; causal LMs do not take them
    else:
        raise HookscopeError(f"inputs of type {type(inputs).__name__}: give input ids [batch, P] or a "
                             "tokenizer's output (input_ids + attention_mask)")
    if not isinstance(ids, Tensor) or ids.ndim != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise HookscopeError("hs.generate needs integer input_ids of shape [batch, prompt length]")
    if ids.shape[1] == 0:
        raise HookscopeError("the prompt is empty; give at least one token")
    if mask is not None and tuple(mask.shape) != tuple(ids.shape):
        raise HookscopeError(f"attention_mask {tuple(mask.shape)} does not match input_ids "
                             f"{tuple(ids.shape)}")
    if mask is not None and ids.shape[0] > 1 and bool((mask[:, -1] == 0).any()):
        raise HookscopeError("the batch is right-padded: a decoder generates after the last column, so pad "
                             "on the left (tokenizer.padding_side = 'left')")
    return ids, mask, extra


def _check_point(spec: PointSpec) -> None:
    if spec.needs_eager:
        raise SelectionError(f"{spec.name}: attention weights grow with the key length at every step; "
                             "capture "
                             "them with hs.collect over gen.sequences (a teacher-forced pass) instead")
    if spec.pos_dim != 1:
        raise SelectionError(f"{spec.name} has no [batch, pos, ...] layout, so it cannot be aligned to "
                             "generated tokens; use a canonical point name (hs.points(model))")


def _eos_ids(model: nn.Module, generate_kwargs: dict) -> list[int]:
    eos = generate_kwargs.get("eos_token_id")
    if eos is None:
        config = generate_kwargs.get("generation_config") or getattr(model, "generation_config", None)
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    if isinstance(eos, Tensor):
        return [int(v) for v in eos.flatten().tolist()]
    return [int(eos)] if isinstance(eos, int) else [int(v) for v in eos]


def _real_tokens(sequences: Tensor, attention_mask: Tensor | None, prompt_length: int,
                 eos: list[int]) -> Tensor:
    """True for prompt tokens the attention mask keeps and for generated tokens up to and
    including the row's first EOS."""
    batch, total = sequences.shape
    mask = torch.ones(batch, total, dtype=torch.bool, device=sequences.device)
    if attention_mask is not None:
        mask[:, :prompt_length] = attention_mask.to(device=sequences.device, dtype=torch.bool)
    if eos and total > prompt_length:
        new = sequences[:, prompt_length:]
        is_eos = torch.isin(new, torch.tensor(eos, device=new.device))
        # positions strictly after the first EOS: an EOS occurred at an earlier generated column
        after = (is_eos.long().cumsum(1) - is_eos.long()) > 0
        mask[:, prompt_length:] = ~after
    return mask


def _is_transformer_lens(model: nn.Module) -> bool:
    return any(c.__module__.startswith("transformer_lens") for c in type(model).__mro__) \
        and hasattr(model, "blocks") and hasattr(model, "unembed")


# modules a HookedTransformer runs inside each forward pass of its generate
_LENS_IN_FORWARD = ("blocks.", "ln_final", "unembed")


def _lens_eos_ids(model: nn.Module, generate_kwargs: dict) -> list[int]:
    if not generate_kwargs.get("stop_at_eos", True):
        return []
    eos = generate_kwargs.get("eos_token_id")
    if eos is None:  # a bridge's adapter may name the stop tokens (chat turn ends) in its config
        eos = getattr(model.cfg, "eos_token_id", None) if is_bridge(model) else None
    if eos is None:
        eos = getattr(getattr(model, "tokenizer", None), "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(v) for v in eos]


def _lens_padded_prompt(model: nn.Module, input_ids: Tensor, attention_mask: Tensor,
                        prepend_bos: bool) -> Tensor:
    """A left-padded batch for HookedTransformer.generate, which takes no attention mask: it reads
    the padding off the leading pad tokens (its tokenizer's pad id). Padding positions get that
    id, and the mask generate will derive is checked to be the one given."""
    tokenizer = getattr(model, "tokenizer", None)
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        raise HookscopeError("a padded batch through HookedTransformer.generate needs the model's "
                             "tokenizer (generate reads the padding off its pad token): "
                             "model.set_tokenizer(tokenizer), or give rows of equal length / generate them "
                             "one by one")
    from transformer_lens.utils import get_attention_mask

    ids = input_ids.masked_fill(attention_mask == 0, pad)
    derived = get_attention_mask(tokenizer, ids, prepend_bos, padding_side="left")
    if not torch.equal(derived.to(attention_mask.device).bool(), attention_mask.bool()):
        raise HookscopeError("HookedTransformer.generate would not see this padding: it treats only "
                             f"leading pad tokens (id {pad}) as padding, so a left-padded batch whose first "
                             "real token is the pad id (or whose mask has holes) cannot be generated "
                             "faithfully; generate such rows one by one")
    return ids


def _full_pass(model: nn.Module, sequences: Tensor, attention_mask: Tensor | None) -> None:
    """A TransformerLens model's pass over the whole final sequence (its generate returns no
    cache), with the prompt's padding masked, so the last token's activations are filed."""
    call: dict[str, Any] = {}
    if attention_mask is not None:
        full = torch.ones_like(sequences)
        full[:, :attention_mask.shape[1]] = attention_mask.to(sequences.device)
        call["attention_mask"] = full
    with torch.inference_mode():
        model(sequences, **call)


# --- following the forward passes ----------------------------------------------------------------


@dataclass
class _Steps:
    """Which sequence positions the current forward pass covers."""

    prompt_length: int
    filled: int = 0  # positions [0, filled) have been computed by an earlier pass
    window: tuple[int, int] = (0, 0)  # positions the current pass covers

    def start(self, length: int) -> None:
        if self.filled == 0:
            self.window = (0, length)  # the prompt
        elif length == 1:
            self.window = (self.filled, self.filled + 1)  # one new token, the rest in the KV cache
        elif length == self.filled + 1:
            self.window = (0, length)  # no cache: the whole sequence again
        else:
            raise HookscopeError(f"a forward pass over {length} positions after {self.filled} were computed: "
                                 "this decoding mode does not run one token per step")


def _input_length(args: tuple, kwargs: dict) -> int | None:
    for value in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), args[0] if args else None):
        if isinstance(value, Tensor) and value.ndim >= 2:
            return value.shape[1]
    return None


_CACHE_KWARGS = ("past_key_values", "cache")  # the KV cache a step is given (transformers < / >= 5.24)


def _check_cache_filled(kwargs: dict, filled: int) -> None:
    """A one-token step reads the earlier positions from its KV cache: an empty cache means the model
    computes the new token without its context, and every token and activation after the prompt is
    wrong. TransformerLens 4.3's bridge does that with transformers >= 5.24 (its attention neither
    fills nor reads the cache transformers gives it), silently; refuse instead. Only an empty cache
    is refused: a sliding-window cache may hold fewer positions than were computed."""
    for key in _CACHE_KWARGS:
        cache = kwargs.get(key)
        if cache is not None and callable(getattr(cache, "get_seq_length", None)):
            if cache.get_seq_length() == 0:
                raise HookscopeError(
                    f"generate ran a one-token step after {filled} positions with an empty KV cache: the "
                    "model computed the new token without its context, so its tokens and activations would "
                    "be wrong. TransformerLens 4.3's TransformerBridge does this with transformers >= 5.24; "
                    "pass use_past_kv_cache=False (a bridge) or use_cache=False (each step then recomputes "
                    "the whole sequence), or install transformers<5.24")
            return


@contextlib.contextmanager
def _root_hooks(first: nn.Module, last: nn.Module, steps: _Steps, step_edits: list[_StepEdit], cap: Any,
                kept: dict[str, _Kept]) -> Iterator[None]:
    """A pre-hook that tells the edits which positions this pass covers, and a forward hook that
    files each point's capture at those positions. Plain torch hooks on the root module (on a
    HookedTransformer, whose generate calls `forward` directly: before its first block, after its
    unembed), which run eagerly under every compile policy (`full` compiles forward, not hooks)."""

    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        length = _input_length(args, kwargs)
        if length is None:
            raise HookscopeError("cannot tell the sequence length of a forward pass during generate")
        steps.start(length)
        if length == 1 and steps.filled > 0:  # one new token, the rest read from the KV cache
            _check_cache_filled(kwargs, steps.filled)
        for step_edit in step_edits:
            step_edit.prepare()

    def after(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        lo, hi = steps.window
        for name, keeper in kept.items():
            chunk = cap[name]
            if chunk.shape[1] != hi - lo:
                raise HookscopeError(f"{name}: a pass over positions [{lo}, {hi}) produced {chunk.shape[1]} "
                                     "positions at this point")
            keeper.add(chunk[:, steps.filled - lo:], steps.filled)
        steps.filled = hi

    handles = [first.register_forward_pre_hook(before, with_kwargs=True),
               last.register_forward_hook(after, with_kwargs=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _final_step(model: nn.Module, output: Any, sequences: Tensor, attention_mask: Tensor | None,
                extra: dict) -> None:
    """Run the model on the last sampled token, which `generate` never feeds back, so that its
    activations exist too: one more cached step, with the position id and attention mask
    `generate` would have given it; without a cache, the whole sequence once more."""
    batch, total = sequences.shape
    full_mask = torch.ones(batch, total, dtype=torch.long, device=sequences.device)
    if attention_mask is not None:
        full_mask[:, :attention_mask.shape[1]] = attention_mask
    cache = getattr(output, "past_key_values", None)
    accepted = _forward_parameters(type(model))
    call: dict[str, Any] = {"attention_mask": full_mask}
    if cache is not None:
        call.update(input_ids=sequences[:, -1:], past_key_values=cache, use_cache=True)
        if "position_ids" in accepted:
            # as generate counts them: real tokens before this one (left padding does not count)
            call["position_ids"] = (full_mask.cumsum(-1)[:, -1:] - 1).clamp(min=0)
    else:
        call["input_ids"] = sequences
        if "use_cache" in accepted:
            call["use_cache"] = False
        if "position_ids" in accepted and attention_mask is not None:
            call["position_ids"] = (full_mask.cumsum(-1) - 1).masked_fill(full_mask == 0, 0)
    call.update({k: v for k, v in extra.items() if k in accepted})
    with torch.inference_mode():
        model(**call)


@functools.cache
def _forward_parameters(cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(cls.forward).parameters)


# --- keeping captures -----------------------------------------------------------------------------


class _SequenceDims:
    """The dims of a [batch, position] table of sequence positions (for `Selection.select`)."""

    pos_dim, head_dim = 1, None


_SEQUENCE = _SequenceDims()


class _Kept:
    """One point's captured positions, filed chunk by chunk; keeps only the positions the
    selection can still need (a negative index is only known at the end: a tail is kept)."""

    def __init__(self, positions: Positions):
        self.positions = positions
        self.every = positions is None
        self.exact: set[int] = set()  # non-negative positions the selection names
        self.from_: int | None = None  # keep every position from here on
        self.tail = 0  # keep the last `tail` positions seen
        if not self.every:
            self._plan(positions)
        self.chunks: list[tuple[Tensor, list[int]]] = []
        self.tail_x: Tensor | None = None
        self.tail_pos: list[int] = []

    def _plan(self, positions: Positions) -> None:
        if isinstance(positions, str):
            if positions != "last":
                raise SelectionError(f"positions={positions!r}: use 'last', an int, a slice, a list or a "
                                     "tensor")
            self.tail = 1
            return
        if isinstance(positions, slice):
            start, stop = positions.start, positions.stop
            if positions.step is not None and (not isinstance(positions.step, int) or positions.step < 1):
                raise SelectionError(f"positions={positions!r}: a slice needs int bounds and a positive step")
            if start is not None and start < 0:
                self.tail = max(self.tail, -start)
                if stop is not None and stop >= 0:
                    self.from_ = 0
            elif stop is not None and stop >= 0:
                self.exact.update(range(start or 0, stop))
            else:
                self.from_ = start or 0
            return
        if isinstance(positions, bool):
            raise SelectionError(f"positions={positions!r}: use 'last', an int, a slice, a list or a tensor")
        values = positions.flatten().tolist() if isinstance(positions, Tensor) else positions
        if isinstance(values, int):
            values = [values]
        try:
            values = [int(v) for v in values]
        except (TypeError, ValueError):
            raise SelectionError(f"positions={positions!r}: use 'last', an int, a slice, a list or a "
                                 "tensor of ints") from None
        for v in values:
            if v < 0:
                self.tail = max(self.tail, -v)
            else:
                self.exact.add(v)

    def add(self, chunk: Tensor, start: int) -> None:
        n = chunk.shape[1]
        if self.every:
            self.chunks.append((chunk, list(range(start, start + n))))
            return
        wanted = [i for i in range(n) if start + i in self.exact or
                  (self.from_ is not None and start + i >= self.from_)]
        if wanted:
            idx = torch.tensor(wanted, device=chunk.device)
            self.chunks.append((chunk.index_select(1, idx), [start + i for i in wanted]))
        if self.tail:
            x = chunk if self.tail_x is None else torch.cat([self.tail_x, chunk], dim=1)
            pos = self.tail_pos + list(range(start, start + n))
            self.tail_x, self.tail_pos = x[:, -self.tail:], pos[-self.tail:]

    def result(self, total: int, batch: int) -> Tensor:
        columns: dict[int, tuple[Tensor, int]] = {}
        parts = list(self.chunks) + ([(self.tail_x, self.tail_pos)] if self.tail_x is not None else [])
        if self.every:
            x = torch.cat([c for c, _ in self.chunks], dim=1)
            return x.expand(batch, *x.shape[1:]) if x.shape[0] == 1 and batch > 1 else x
        # collect's selection rules (and its errors), applied to the sequence's position numbers
        where = Selection.of(positions=self.positions).select(torch.arange(total).expand(batch, total),
                                                              _SEQUENCE)
        for c, pos in parts:
            for i, p in enumerate(pos):
                columns[p] = (c, i)
        order = sorted(columns)
        kept = torch.stack([columns[p][0].select(1, columns[p][1]) for p in order], dim=1)
        if kept.shape[0] == 1 and batch > 1:
            kept = kept.expand(batch, *kept.shape[1:])
        lookup = torch.full((total,), -1, dtype=torch.long)
        lookup[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
        idx = lookup[where].to(kept.device)
        rows = torch.arange(batch, device=kept.device)
        if idx.ndim == 1:
            return kept[rows, idx]
        return kept[rows[:, None], idx]


# --- edits during generation -------------------------------------------------------------------------


class _StepEdit:
    """An edit made to follow sequence positions. `prepare` (eager, before each pass) decides
    what this pass edits; `__call__` (the hook, traced into a compiled block under `blocks`)
    only reads that decision, so one graph per decision serves every step."""

    def __init__(self, edit: Any, edit_on: str, steps: _Steps, spec: PointSpec):
        self.edit, self.edit_on, self.steps, self.spec = edit, edit_on, steps, spec
        if spec.pos_dim != 1:
            raise SelectionError(f"edit on {spec.name}: the point has no [batch, pos, ...] layout to follow "
                                 "during "
                                 "generation; use a canonical point name (hs.points(model))")
        positions = getattr(edit, "positions", None)
        self.positions: set[int] | None = None
        if positions is not None:
            self.positions = _absolute_positions(positions, spec.name)
        self.source = getattr(edit, "source", None)  # a patch reads its source at the pass's positions
        self.inner = edit
        if positions is not None or self.source is not None:
            if not dataclasses.is_dataclass(edit):
                raise HookscopeError(f"edit on {spec.name}: {type(edit).__name__} cannot be restricted to "
                                     "positions during generation")
            self.inner = dataclasses.replace(edit, positions=None)
        self.mode = "none"  # "all" | "none" | "mask", for the current pass
        self.mask: Tensor | None = None

    def prepare(self) -> None:
        lo, hi = self.steps.window
        p = self.steps.prompt_length
        edited = [q for q in range(lo, hi) if self._chosen(q, p)]
        if self.source is not None:
            self._slice_source(lo, hi, edited)
        if len(edited) == hi - lo:
            self.mode, self.mask = "all", None
        elif not edited:
            self.mode, self.mask = "none", None
        else:
            keep = torch.zeros(hi - lo, dtype=torch.bool)
            keep[torch.tensor(edited) - lo] = True
            self.mode, self.mask = "mask", keep

    def _chosen(self, q: int, prompt_length: int) -> bool:
        if self.edit_on == "prompt" and q >= prompt_length:
            return False
        if self.edit_on == "generated" and q < prompt_length:
            return False
        return self.positions is None or q in self.positions

    def _slice_source(self, lo: int, hi: int, edited: list[int]) -> None:
        source = self.source
        have = source.shape[1]
        if edited and edited[-1] >= have:
            raise SelectionError(f"patch {self.spec.name}: the source covers {have} positions but position "
                                 f"{edited[-1]} is to be patched; restrict the patch (positions=, edit_on="
                                 "'prompt') or give a longer source")
        part = source[:, lo:min(hi, have)]
        if part.shape[1] < hi - lo:  # positions past the source are left as they are (never selected)
            filler = torch.zeros((source.shape[0], hi - lo - part.shape[1], *source.shape[2:]),
                                 dtype=source.dtype, device=source.device)
            part = torch.cat([part, filler], dim=1)
        self.inner = dataclasses.replace(self.edit, positions=None, source=part)

    def __call__(self, act: Tensor, hook: Hook) -> Tensor | None:
        if self.mode == "none":
            return None
        new = self.inner(act, hook)
        if self.mode == "all":
            return new
        shape = [1] * act.ndim
        shape[1] = act.shape[1]
        return torch.where(self.mask.to(act.device).view(shape), new, act)


def _absolute_positions(positions: Positions, name: str) -> set[int]:
    if isinstance(positions, slice):
        if positions.stop is None or any(v is not None and v < 0 for v in
                                         (positions.start, positions.stop, positions.step)):
            raise SelectionError(f"edit on {name}: during generation positions= counts from the start of the "
                                 "sequence; give a slice with non-negative start and stop (or use edit_on=)")
        return set(range(positions.start or 0, positions.stop, positions.step or 1))
    if isinstance(positions, str) or isinstance(positions, bool):
        raise SelectionError(f"edit on {name}: positions={positions!r} has no meaning before the sequence "
                             "ends; give sequence positions (ints) or use edit_on='prompt'/'generated'")
    values = positions.flatten().tolist() if isinstance(positions, Tensor) else positions
    values = [values] if isinstance(values, int) else list(values)
    if any(int(v) < 0 for v in values):
        raise SelectionError(f"edit on {name}: negative positions have no meaning before the sequence ends; "
                             "give positions counted from the start")
    return {int(v) for v in values}


# --- extraction on the model's own continuations (hookscope extract --generate N) -------------------


def generate_rows(model: nn.Module, batch: Mapping[str, Tensor], points: Sequence[str], new_tokens: int,
                  keep: Tensor, *, dtype: torch.dtype | None = None,
                  device: torch.device | str = "cpu") -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """One packed batch of `hookscope extract --generate N`: greedy-generate `new_tokens` after each
    sequence and return store rows, `{point: [rows, ...]}` and the per-row columns (token_ids,
    doc_ids, positions, seq_ids). Rows run sequence by sequence: its kept prompt tokens (`keep`,
    [batch, context]), then its generated tokens up to and including EOS. A continuation belongs
    to the last document of its sequence; its positions go on from that document's last token.
    Greedy decoding is deterministic, so a resumed extraction regenerates the same rows."""
    run_device = batch["input_ids"].device
    mask = batch["attention_mask"].bool().cpu()
    # packed rows are right-padded (if at all); a decoder continues after the last column
    order = torch.argsort((~mask).long() * -1, dim=1, stable=True)  # padding first, real tokens after
    left = {k: torch.gather(batch[k].cpu(), 1, order) for k in ("input_ids", "attention_mask", "doc_ids",
                                                                 "doc_positions")}
    keep = torch.gather(keep.cpu(), 1, order)
    pad = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
    if pad is None:
        pad = getattr(getattr(model, "generation_config", None), "eos_token_id", None) or 0
    pad = pad[0] if isinstance(pad, (list, tuple)) else pad
    gen = generate(model, {"input_ids": left["input_ids"].to(run_device),
                           "attention_mask": left["attention_mask"].to(run_device)},
                   list(points), dtype=dtype, device=device, max_new_tokens=new_tokens,
                   min_new_tokens=0, do_sample=False, pad_token_id=pad)
    total_new = gen.sequences.shape[1] - gen.prompt_length
    rows_mask = torch.cat([keep.cpu(), gen.mask[:, gen.prompt_length:].cpu()], dim=1)
    steps = torch.arange(1, total_new + 1)
    # the last token of a document (not a separator / padding, whose doc id is -1)
    in_doc = left["doc_ids"] >= 0
    last = (in_doc.long() * torch.arange(in_doc.shape[1])).argmax(dim=1, keepdim=True)
    last_doc = torch.gather(left["doc_ids"], 1, last).expand(-1, total_new)
    last_pos = torch.gather(left["doc_positions"], 1, last) + steps
    acts = {name: value[rows_mask.to(value.device)] for name, value in gen.activations.items()}
    meta = {
        "token_ids": gen.sequences.cpu()[rows_mask],
        "doc_ids": torch.cat([left["doc_ids"], last_doc], dim=1)[rows_mask],
        "positions": torch.cat([left["doc_positions"], last_pos], dim=1)[rows_mask],
        "seq_ids": batch["seq_ids"].unsqueeze(1).expand_as(rows_mask)[rows_mask],
    }
    return acts, meta
