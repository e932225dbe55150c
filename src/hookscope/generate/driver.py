"""`hs.generate`: check everything, then generate once with the edits and the capture attached and
the passes followed (`steps.follow`, `keep.Kept.file`), then shape what was kept."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..arch import PointSpec, arch_of
from ..capture import PointDict, keyed_specs
from ..errors import HookscopeError, SelectionError
from ..hooks import hooks
from ..selection import Heads, Positions, Selection
from .backend import Backend
from .bridge import Bridge
from .edits import EDIT_ON, StepEdit
from .hf import HuggingFace
from .keep import Kept, StepCapture
from .lens import Lens
from .result import Generation, real_tokens
from .steps import Steps, follow

# decoding modes whose forward passes do not map one-to-one onto sequence positions
_UNSUPPORTED = {
    "num_beams": "beam search reorders and drops rows between steps",
    "assistant_model": "assisted decoding runs and then rejects draft tokens",
    "prompt_lookup_num_tokens": "prompt-lookup decoding runs and then rejects draft tokens",
    "num_assistant_tokens": "assisted decoding runs and then rejects draft tokens",
    "penalty_alpha": "contrastive search runs candidate tokens it then drops",
}
_BACKENDS = {"tl_bridge": Bridge, "transformer_lens": Lens}  # arch family -> backend; else HuggingFace


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
    """`hs.generate` on a model (`model.generate(**generate_kwargs)`, one batch): the front,
    `hookscope.verbs.generate`, says what each option means and what is raised."""
    selection = Selection.of(positions, heads, None, dtype, device)
    return _Run.checked(model, inputs, points, edits, edit_on, selection, generate_kwargs).go()


@dataclass
class _Run:
    """One checked `hs.generate` call."""

    model: nn.Module
    backend: Backend
    given_ids: Tensor  # the prompt as given
    input_ids: Tensor  # what generate is given (a HookedTransformer's padding as pad ids)
    attention_mask: Tensor | None
    extra: dict  # other model inputs of the tokenizer's output
    keys: dict[str, PointSpec]  # the points, keyed by the names asked for (as `hs.collect` keys them)
    selection: Selection
    step_edits: list[StepEdit]
    steps: Steps

    @classmethod
    def checked(
        cls,
        model: nn.Module,
        inputs: Any,
        points: str | Sequence[str],
        edits: Sequence[Any],
        edit_on: str,
        selection: Selection,
        options: dict,
    ) -> _Run:
        if edit_on not in EDIT_ON:
            raise SelectionError(f"edit_on={edit_on!r}: use one of {', '.join(EDIT_ON)}")
        arch = arch_of(model)
        if arch.loaded is not None:
            arch.loaded.require_output("hs.generate samples each token from the model's logits")
        _check_decoding(model, options)
        backend = _BACKENDS.get(arch.family, HuggingFace)(model, options)
        given_ids, attention_mask, extra = _split_inputs(inputs)
        input_ids, attention_mask = backend.prompt(given_ids, attention_mask)
        keys = keyed_specs(arch, points) if points else {}
        for spec in keys.values():
            _check_point(spec, selection)
            backend.check_point(spec)
        prompt_length = input_ids.shape[1]
        step_edits = [StepEdit.checked(e, arch, model, edit_on, prompt_length) for e in edits]
        return cls(
            model,
            backend,
            given_ids,
            input_ids,
            attention_mask,
            extra,
            keys,
            selection,
            step_edits,
            Steps(prompt_length),
        )

    def go(self) -> Generation:
        """Generate with everything attached; the prompt's ids as given in the result."""
        # every position on the activation's device: one buffer per point, sized for the whole sequence
        buffered, capacity = self.selection.device is None, self._expected_length()
        kept = {
            key: Kept(Selection(positions=self.selection.positions), buffered=buffered, capacity=capacity)
            for key in self.keys
        }
        output, sequences, attention_mask = self._generate(kept)
        # made under the capture's inference_mode: a plain copy can feed a later pass with gradients
        sequences = sequences.clone()
        if self.given_ids is not self.input_ids:  # the prompt as given (its padding ids were swapped)
            sequences[:, : self.given_ids.shape[1]] = self.given_ids.to(sequences.device)
        batch, total = sequences.shape
        filled = {k.filled for k in kept.values()}
        if filled and filled != {total}:
            raise HookscopeError(
                f"internal: captured {sorted(filled)} positions for a sequence of "
                f"{total}; this decoding mode does not run one forward pass per token"
            )
        mask = real_tokens(sequences, attention_mask, self.steps.prompt_length, self.backend.eos_ids())
        activations = PointDict(
            ((name, k.result(total, batch)) for name, k in kept.items()), arch=arch_of(self.model)
        )
        return Generation(
            sequences,
            mask,
            self.steps.prompt_length,
            activations,
            output if self.backend.options.get("return_dict_in_generate") else None,
        )

    def _expected_length(self) -> int:
        """The sequence length generate will reach if no row stops early (0 when unknown)."""
        options = self.backend.options
        config = options.get("generation_config") or getattr(self.model, "generation_config", None)
        new = options.get("max_new_tokens", getattr(config, "max_new_tokens", None))
        if isinstance(new, int):
            return self.input_ids.shape[1] + new
        length = options.get("max_length", getattr(config, "max_length", None))
        return length if isinstance(length, int) else 0

    def _generate(self, kept: dict[str, Kept]) -> tuple[Any, Tensor, Tensor | None]:
        model, backend, attention_mask = self.model, self.backend, self.attention_mask
        kwargs = backend.generate_kwargs(self.extra, attention_mask, [s.name for s in self.keys.values()])
        with contextlib.ExitStack() as stack:
            # edits first: a capture on an edited point then sees the value the model goes on with
            edit_hooks = stack.enter_context(hooks(model))
            for step_edit in self.step_edits:
                edit_hooks.forward(step_edit.spec, step_edit)
            cap = None
            if self.keys:
                s = self.selection  # positions are kept step by step (keep.py); the rest by the capture
                cap = stack.enter_context(
                    StepCapture(model, kept, heads=s.heads, dtype=s.dtype, device=s.device)
                )
            stack.enter_context(
                follow(*backend.hooked_modules(), self.steps, self.step_edits, backend.cache_keys)
            )
            output = model.generate(self.input_ids, **kwargs)
            sequences = output.sequences if hasattr(output, "sequences") else output
            if attention_mask is not None and sequences.shape[0] != attention_mask.shape[0]:
                # num_return_sequences: generate repeats each prompt row that many times
                repeats = sequences.shape[0] // attention_mask.shape[0]
                attention_mask = attention_mask.repeat_interleave(repeats, 0)
            if cap is not None and any(k.filled < sequences.shape[1] for k in kept.values()):

                def last() -> None:
                    backend.complete(output, sequences, attention_mask, self.extra)

                if backend.options.get("return_dict_in_generate"):
                    last()  # the caller gets generate's cache: every layer of it sees the last token
                else:
                    cap.run_last(last)  # up to the last captured point only
        return output, sequences, attention_mask


def _check_decoding(model: nn.Module, options: dict) -> None:
    for key, why in _UNSUPPORTED.items():
        value = options.get(key)
        if value is not None and not (key == "num_beams" and value == 1) and value is not False:
            raise HookscopeError(
                f"hs.generate does not support {key}={value!r}: {why}, so captures and "
                "edits cannot follow token positions; use greedy or sampling decoding"
            )
    config = options.get("generation_config") or getattr(model, "generation_config", None)
    beams = options.get("num_beams") or getattr(config, "num_beams", None) or 1
    if beams > 1:
        raise HookscopeError(
            f"hs.generate does not support num_beams={beams} (from the arguments or the "
            f"generation config): {_UNSUPPORTED['num_beams']}; pass num_beams=1"
        )
    if not hasattr(model, "generate"):
        raise HookscopeError(
            f"{type(model).__name__} has no generate(); hs.generate needs a Hugging Face "
            "causal LM (AutoModelForCausalLM)"
        )


def _check_point(spec: PointSpec, selection: Selection) -> None:
    if spec.needs_eager:
        raise SelectionError(
            f"{spec.name}: attention weights grow with the key length at every step; "
            "capture them with hs.collect over gen.sequences (a teacher-forced pass)"
        )
    if spec.pos_dim != 1:
        raise SelectionError(
            f"{spec.name} has no [batch, pos, ...] layout, so it cannot be aligned to "
            "generated tokens; use a canonical point name (hs.points(model))"
        )
    if selection.heads is not None and spec.head_dim is None:
        raise SelectionError(f"{spec.name} has no head dimension: heads= works on attn.q|k|v|z")


def _split_inputs(inputs: Any) -> tuple[Tensor, Tensor | None, dict]:
    if isinstance(inputs, Tensor):
        ids, mask, extra = inputs, None, {}
    elif isinstance(inputs, Mapping):
        # tokenizers add token_type_ids; causal LMs do not take them
        extra = {
            k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "token_type_ids")
        }
        ids, mask = inputs.get("input_ids"), inputs.get("attention_mask")
    else:
        raise HookscopeError(
            f"inputs of type {type(inputs).__name__}: give input ids [batch, P] or a "
            "tokenizer's output (input_ids + attention_mask)"
        )
    if not isinstance(ids, Tensor) or ids.ndim != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise HookscopeError("hs.generate needs integer input_ids of shape [batch, prompt length]")
    if ids.shape[1] == 0:
        raise HookscopeError("the prompt is empty; give at least one token")
    if mask is not None and tuple(mask.shape) != tuple(ids.shape):
        raise HookscopeError(
            f"attention_mask {tuple(mask.shape)} does not match input_ids {tuple(ids.shape)}"
        )
    if mask is not None and ids.shape[0] > 1 and bool((mask[:, -1] == 0).any()):
        raise HookscopeError(
            "the batch is right-padded: a decoder generates after the last column, so pad "
            "on the left (tokenizer.padding_side = 'left')"
        )
    return ids, mask, extra
