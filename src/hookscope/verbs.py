"""`hs.collect`, `hs.capture`, `hs.grads`, `hs.points`, `hs.generate` and `hs.edit` on any model: a
served engine (a vLLM `LLM`) goes to its engine module, anything else to the core (`capture.py`,
`generate/`); `gather=False` on a tensor-parallel model reads the names in the table of each
rank's slices (`engines.tensor_parallel`).

The core sits below the engines in the layers and never imports them; this front sits above both,
so the one verb users know reaches either. An `nn.Module` pays one type check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .arch import Arch
from .capture import Capture, PointDict, PointInfo
from .capture import capture as core_capture
from .capture import collect as core_collect
from .capture import grads as core_grads
from .capture import points as core_points
from .edit import Edit, Edits
from .edit import edit as core_edit
from .engines import tensor_parallel, vllm
from .engines.vllm import edit_block, generating
from .errors import EngineError
from .generate import Generation
from .generate import generate as core_generate
from .selection import Heads, Positions


# one argument past the rule's 12: each option of the verb named in its signature (pyproject.toml)
def collect(  # noqa: PLR0913
    model: Any,
    inputs: Any,
    points: str | Sequence[str],
    *,
    positions: Positions = None,
    heads: Heads = None,
    token_mask: Tensor | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    stop: bool = True,
    inference: bool = True,
    attention_mask: Tensor | None = None,
    arch: Arch | None = None,
    gather: bool = True,
) -> PointDict | list[PointDict]:
    """Run the model on `inputs` and return `{point: activation}`; no layer after the last
    needed point runs. On a vLLM engine (`vllm.LLM`), `inputs` are prompts (strings or token id
    lists) and the result is one `PointDict` per prompt, each point `[n_tokens, ...]`: every token of
    the prompt, attributed to its request; `positions`, `heads`, `dtype` and `device` keep of it what
    they keep of that prompt run alone (row 0 of `hs.collect` on a batch of it), positions counted in
    the prompt (the other options are for `nn.Module`s).

    Args:
        model: a Hugging Face or TransformerLens model, any `nn.Module`, or a vLLM `LLM`.
        inputs: what the model is called with: a tensor of token ids, or a dict (a tokenizer's
            output: its `attention_mask` is read for `positions="last"`); prompts for an engine.
        points: a name, a glob (`blocks.*.resid_post`), a comma-separated string or a list.
        positions: which positions to keep (as `capture`); None keeps all.
        heads: which heads of `attn.q|k|v|z` / `attn.pattern` to keep; None keeps all.
        token_mask: a `[batch, pos]` bool tensor: the tokens kept, as rows `[n_tokens, ...]`.
        dtype: the dtype kept (a cast on the model's device, before any copy); None keeps it.
        device: where the kept copies go (`"cpu"`: to the host without waiting for the device).
        stop: False runs the whole model (e.g. to keep its key/value cache use as it is).
        inference: run under `torch.inference_mode`.
        attention_mask: the batch's mask for `positions="last"`; by default the one in `inputs`.
        arch: the table the names are read in; by default the model's own (as `capture`).
        gather: on a tensor-parallel model (`hs.load(..., tp=N)`), False keeps each point sharded
            across the ranks as this rank's slice (its `hs.points` label names the slice) instead
            of gathering the whole tensor; whole points (the residual stream) are whole either way.

    Returns:
        PointDict: `{point: tensor}`, keyed by the names asked for (a glob: one key per point); on
        a vLLM engine, a list of them, one per prompt.

    Raises:
        UnknownPointError: a point name the model does not have (the message lists close names).
        SelectionError: positions, heads or a token mask that do not fit the point.
        PointNotReachedError: a point that never ran in the forward pass (an encoder's `logits`).
        EngineError: an engine hookscope cannot read exactly, or an option it does not take yet.
        TensorParallelError: `gather=False` on a model that is not tensor-parallel, or beside
            `heads=` or `arch=`."""
    selections = dict(positions=positions, heads=heads, dtype=dtype, device=device)
    if vllm.is_llm(model):
        given = ["token_mask"] if token_mask is not None else []
        given += ["arch"] if arch is not None else []
        given += ["gather"] if not gather else []
        if given:
            raise EngineError(
                f"hs.collect on a vLLM engine takes no {', '.join(given)} yet: each prompt is its own "
                "request (no padded batch for a token mask); select tokens with positions= (counted in "
                "each prompt) or from the rows it returns"
            )
        return vllm.collect(model, inputs, points, **selections)
    return core_collect(
        model,
        inputs,
        points,
        **selections,
        token_mask=token_mask,
        stop=stop,
        inference=inference,
        attention_mask=attention_mask,
        arch=_table(model, arch, gather, heads),
    )


# one argument past the rule's 12: each option of the verb named in its signature (pyproject.toml)
def capture(  # noqa: PLR0913
    model: nn.Module,
    points: str | Sequence[str],
    *,
    positions: Positions = None,
    heads: Heads = None,
    token_mask: Tensor | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    stop: bool | None = None,
    inference: bool = True,
    accumulate: bool = False,
    attention_mask: Tensor | None = None,
    arch: Arch | None = None,
    gather: bool = True,
) -> Capture:
    """Hooks that keep copies of `points` while the `with` block runs; see `Capture`.

    Args:
        model: a Hugging Face or TransformerLens model, or any `nn.Module` (raw `module:` names).
        points: a name, a glob (`blocks.*.resid_post`), a comma-separated string or a list.
        positions: which positions to keep: an int, a slice, a list or 1-D tensor of ints, or
            `"last"` (each row's last real token under the attention mask); None keeps all.
        heads: which heads of `attn.q|k|v|z` / `attn.pattern` to keep (ints); None keeps all.
        token_mask: a `[batch, pos]` bool tensor: the tokens kept, as rows `[n_tokens, ...]`.
        dtype: the dtype kept (a cast on the model's device, before any copy); None keeps it.
        device: where the kept copies go (`"cpu"`: to the host without waiting for the device).
        stop: True ends every forward pass once the last point has been kept (the rest of the
            model never runs; the block's body sees the pass end quietly); None (the default)
            lets the block's passes run whole and stops only `cap.run(inputs)`; False stops none.
        inference: run under `torch.inference_mode` while the block is open.
        accumulate: keep every pass's values, concatenated along the batch on read.
        attention_mask: the batch's mask for `positions="last"`; by default the `attention_mask=`
            each pass is called with.
        arch: the table the names are read in; by default the model's own.
        gather: on a tensor-parallel model, False keeps each sharded point as this rank's slice
            (as `collect`).

    Returns:
        Capture: a `with` block; inside it and after, `cap[point]` is the kept copy.

    Raises:
        UnknownPointError: a point name the model does not have.
        SelectionError: an option that does not fit (checked when it is built) or the activation.
        TensorParallelError: `gather=False` on a model that is not tensor-parallel, or beside
            `heads=` or `arch=`."""
    return core_capture(
        model,
        points,
        positions=positions,
        heads=heads,
        token_mask=token_mask,
        dtype=dtype,
        device=device,
        stop=stop,
        inference=inference,
        accumulate=accumulate,
        attention_mask=attention_mask,
        arch=_table(model, arch, gather, heads),
    )


def grads(
    model: nn.Module,
    inputs: Any,
    points: str | Sequence[str],
    loss_fn: Callable[[Any], Tensor],
    *,
    arch: Arch | None = None,
    gather: bool = True,
) -> PointDict:
    """d loss / d activation at each point, where `loss = loss_fn(model_output)` is a scalar.
    Keyed like `collect`: by the names asked for.

    Args:
        model: a Hugging Face or TransformerLens model, or any `nn.Module`.
        inputs: what the model is called with (as `collect`).
        points: a name, a glob, a comma-separated string or a list.
        loss_fn: the model's output -> a scalar tensor.
        arch: the table the names are read in; by default the model's own.
        gather: on a tensor-parallel model, the gradient at a sharded point is whole (equal to
            the unsharded model's); False gives the gradient of this rank's slice.

    Returns:
        PointDict: `{point: gradient}`, shaped like the activations (zeros where the loss ignores it).

    Raises:
        UnknownPointError: a point name the model does not have.
        PointNotReachedError: a point that never ran in the forward pass.
        SelectionError: `loss_fn` returned something other than a scalar tensor.
        TensorParallelError: `gather=False` on a model that is not tensor-parallel, or beside
            `arch=`."""
    return core_grads(model, inputs, points, loss_fn, arch=_table(model, arch, gather, None))


def _table(model: nn.Module, arch: Arch | None, gather: bool, heads: Heads) -> Arch | None:
    """The table a verb reads the names in: `arch` (None: the model's own), or with
    `gather=False` the tensor-parallel table of this rank's slices, checked before any work."""
    if gather:
        return arch
    return tensor_parallel.kept_shards(model, arch=arch, heads=heads)


def points(model: Any, example: Any = None, *, pattern: str | None = None) -> list[PointInfo]:
    """The model's hook points in execution order; with an example input, their shapes too
    (measured by one forward pass under inference_mode). On a model loaded with `points=`, the
    shapes of the points its weights reach (the pass stops there); the others have none. On a vLLM
    engine, the points its model class has, from hookscope's table of that class.

    Returns:
        list[PointInfo]: one per point, in execution order.

    Raises:
        UnknownPointError: a pattern that matches no point of the model."""
    if vllm.is_llm(model):
        infos = vllm.points(model)
        if pattern is not None:
            from .names import expand

            keep = set(expand(pattern, [p.name for p in infos]))
            infos = [p for p in infos if p.name in keep]
        return infos
    return core_points(model, example, pattern=pattern)


def generate(
    model: Any,
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
) -> Generation | list[Generation]:
    """Generate, capturing `points` and applying `edits` (from `hs.steer` / `hs.ablate` /
    `hs.patch`) at every step. On a model: `model.generate(**generate_kwargs)`, one batch. On a vLLM
    engine (`vllm.LLM`): `inputs` are prompts, run together as vLLM batches them, and the result is
    one `Generation` per prompt, equal to that prompt generated alone (see docs/served.md).

    Args:
        model: a Hugging Face causal LM, a TransformerLens 3 `HookedTransformer` (its own generate;
            a padded batch needs its tokenizer's pad id), a TransformerLens 4 `TransformerBridge`,
            or a vLLM `LLM` made by `hookscope.engines.vllm.llm`.
        inputs: input ids [batch, P], or a tokenizer's output (a mapping with `input_ids` and
            `attention_mask`; pad on the left for a batch of different lengths); on an engine,
            prompts (strings or token id lists).
        points: the points captured at every step (a name, a glob, a list); none by default.
        edits: `hs.steer` / `hs.ablate` / `hs.patch` edits applied at every step; on an engine
            also one list per prompt, so the requests of one batch carry different edits.
        edit_on: "prompt", "generated" or "both".
        positions: which positions to keep, counted over the whole final sequence (as
            `hs.collect`); on an engine, each prompt's own sequence.
        heads: which heads of `attn.q|k|v|z` to keep.
        dtype: the dtype kept (on an engine, cast in its workers).
        device: where the kept copies go.
        **generate_kwargs: `model.generate`'s options (`max_new_tokens`, `do_sample`, ...); on an
            engine `max_new_tokens` and `vllm.SamplingParams` options (greedy unless a
            temperature is given).

    Activations at padding and after a row's EOS are kept as computed; `Generation.mask` says
    which positions hold real tokens. Everything is checked (points, selections, edits, decoding
    mode, inputs) before the model generates.

    Returns:
        Generation: the sequences, their mask, and `gen[point]`: `[batch, T, ...]` per point; on
        an engine, a list of them, one per prompt, each `[1, T, ...]`.

    Raises:
        UnknownPointError: a point or edit on a name the model does not have.
        SelectionError: a selection or edit that cannot follow the steps (`attn.pattern`, a bad
            `edit_on`, heads on a point without heads).
        HookscopeError: a model with no `generate`, beam search, or malformed inputs.
        EngineError: on an engine, n > 1, beam search, or an option vLLM's SamplingParams lacks;
            `EditFailed` for an edit that raised in the engine's forward (the engine goes on)."""
    selections = dict(positions=positions, heads=heads, dtype=dtype, device=device)
    if vllm.is_llm(model):
        return generating.generate(
            model, inputs, points, edits=edits, edit_on=edit_on, **selections, **generate_kwargs
        )
    return core_generate(model, inputs, points, edits=edits, edit_on=edit_on, **selections, **generate_kwargs)


def edit(model: Any, *edits: Edit) -> Edits | edit_block.EditBlock:
    """Apply edits (`hs.steer` / `hs.ablate` / `hs.patch`) for the length of a `with` block.

    Edits write new tensors (never in place); a `hs.capture` opened inside sees the edited values.
    On a vLLM engine (`vllm.LLM`) they apply to every token, prefill and decode, of every request
    the engine runs inside the block: `hs.collect`, `hs.generate` and the engine's own
    `llm.generate`; positions count in each request from its first token, a patch names the ones
    it writes (its source is `[n_tokens, ...]`, a request's own rows), and prefix caching must be
    off. On either, edits at one point apply in the order they were attached: an outer block's,
    then a nested block's, then those a call inside gives (`hs.generate(..., edits=)`). Leaving the
    block (also on an error) removes them all.

    Returns:
        Edits: a `with` block; the edits apply to every forward pass inside it (on a vLLM engine an
        `EditBlock`, whose edits apply in its workers).

    Raises:
        UnknownPointError: an edit on a point the model does not have (or that vLLM never exposes).
        HookscopeError: an edit on a point the model never reads back (a Hugging Face attention pattern).
        EngineError: on an engine, an edit kind it does not take, a patch without bounded positions,
            prefix caching on, or, at a point tensor-parallel ranks hold slices of, a value that
            does not fit the whole point."""
    if vllm.is_llm(model):
        return edit_block.EditBlock(model, edits)
    return core_edit(model, *edits)
