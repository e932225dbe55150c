"""`hs.generate` on a vLLM engine: captures on every token the engine runs (prefill and decode) and
edits on every token of their own request, one `Generation` per prompt.

The engine never runs the last token it samples; Hugging Face's `hs.generate` does (its activations
are part of the result). So with points to capture the engine is asked for one token more, run but
left out of the result; a request that stopped on its own (EOS, a stop token) before that has its
last token run in one follow-up prefill of prompt + generated tokens, its edits applied there too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...capture import PointDict
from ...errors import EngineError, SelectionError
from ...generate import EDIT_ON, Generation
from ...selection import Heads, Positions, Selection
from . import _prompts, check_engine, checked_selection, describe_edits, moved, resolve, run_requests
from .edits import describe_selection
from .worker import REQUEST_ROWS

# options whose rows would not map to one request and position, and the fix
_REFUSED = {
    "best_of": "best_of runs several sequences per request: submit the prompt several times",
    "num_beams": "beam search runs and drops candidate sequences: use greedy or sampling decoding",
    "use_beam_search": "beam search runs and drops candidate sequences: use greedy or sampling decoding",
    "beam_width": "beam search runs and drops candidate sequences: use greedy or sampling decoding",
}
# set by hs.generate itself (each request's tag, the prefix-cache bypass, the shallow copy, the length)
_OWN = ("extra_args", "skip_reading_prefix_cache", "skip_clone", "max_tokens")


def sampling_options(options: dict) -> dict:
    """`vllm.SamplingParams` keywords for `options` (greedy unless a temperature is given), or an
    EngineError naming the fix, before any work."""
    from vllm import SamplingParams

    for key, why in _REFUSED.items():
        if key in options:
            raise EngineError(f"hs.generate on a vLLM engine does not take {key}={options[key]!r}: {why}")
    n = options.get("n", 1)
    if n != 1:
        raise EngineError(
            f"hs.generate on a vLLM engine takes n=1 (got n={n}): several sequences of one request would "
            "share its rows; submit the prompt n times (with different seeds for sampling)"
        )
    fields = [f for f in SamplingParams.__struct_fields__ if not f.startswith("_")]
    unknown = [k for k in options if k not in fields or k in _OWN]
    if unknown:
        raise EngineError(
            f"hs.generate on a vLLM engine takes no {', '.join(unknown)}: it takes max_new_tokens, edits, "
            f"edit_on and vllm.SamplingParams options ({', '.join(f for f in fields if f not in _OWN)})"
        )
    return {"temperature": 0.0, **options}


def generate(
    engine,
    prompts: Any,
    points: str | Sequence[str] = (),
    *,
    edits: Sequence[Any] = (),
    edit_on: str = "both",
    max_new_tokens: int = 16,
    positions: Positions = None,
    heads: Heads = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    **options: Any,
) -> list[Generation]:
    """Generate from each prompt on the engine (its requests batched as vLLM batches them), capturing
    `points` on every prompt and generated token and applying `edits` (hs.steer / hs.ablate /
    hs.patch, for every prompt, or one list per prompt) on every token of their own request.
    `options`: vllm.SamplingParams keywords (greedy, temperature=0, unless given). `heads` and
    `dtype` are taken in the workers; `positions` (over the whole final sequence, as Hugging Face's
    `hs.generate` counts them) once the sequence is complete, here: counted from its end, they name
    rows the workers cannot know while the request runs (and a request that stopped on its own gets
    its last token from a follow-up prefill).

    Returns:
        list[Generation]: one per prompt, as Hugging Face's `hs.generate` returns for that prompt
        alone: `sequences` [1, T] (prompt + generated tokens, up to and including a stop token),
        `gen[point]` [1, T, ...], `output` vLLM's RequestOutput.

    Raises:
        EngineError: see `collect`; n > 1, best_of, beam search, options SamplingParams lacks; edits
            under prefix caching.
        UnknownPointError: a point the model lacks or vLLM never exposes.
        SelectionError: an edit or edit_on that cannot follow the generated positions."""
    if edit_on not in EDIT_ON:
        raise SelectionError(f"edit_on={edit_on!r}: use one of {', '.join(EDIT_ON)}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise EngineError(f"max_new_tokens={max_new_tokens!r}: give a whole number of tokens, 1 or more")
    architecture, arch = check_engine(engine)
    keys = resolve(arch, points) if points else {}
    selection = checked_selection(
        arch, keys.values(), positions=positions, heads=heads, dtype=dtype, device=device
    )
    # heads and dtype in the workers, positions here once each sequence is complete
    in_workers = describe_selection(Selection.of(heads=selection.heads, dtype=selection.dtype))
    kept = Selection.of(positions=selection.positions)
    sampling = sampling_options(options)
    requests = _prompts(prompts)
    described = describe_edits(engine, arch, edits, len(requests))
    names = list(keys.values())
    # with points, one token more: the engine then runs the last token of the result
    asked = {**sampling, "max_tokens": max_new_tokens + (1 if names else 0)}
    outputs, rows = run_requests(
        engine,
        architecture,
        requests,
        [asked] * len(requests),
        names,
        described,
        prefill_only=False,
        edit_on=edit_on,
        selection=in_workers,
    )
    sequences = [
        list(out.prompt_token_ids) + list(out.outputs[0].token_ids)[:max_new_tokens] for out in outputs
    ]
    if names:
        _run_last_tokens(
            engine, architecture, outputs, sequences, names, described, edit_on, rows, in_workers
        )
    results = []
    for i, (out, sequence) in enumerate(zip(outputs, sequences, strict=True)):
        taken = {name: moved(kept.take(rows[i][name], REQUEST_ROWS, copy=False), selection) for name in names}
        activations = PointDict(((key, taken[name][None]) for key, name in keys.items()), arch=arch)
        ids = torch.tensor([sequence])
        mask = torch.ones_like(ids, dtype=torch.bool)  # vLLM stops a request at its stop token
        results.append(Generation(ids, mask, len(out.prompt_token_ids), activations, out))
    return results


def _run_last_tokens(
    engine, architecture, outputs, sequences, names, described, edit_on, rows, in_workers
) -> None:
    """Cut each request's rows to its sequence, and run the last token of the requests whose engine
    never ran it (they stopped before the extra token) in one follow-up prefill (prompt + generated
    tokens, the last row kept), with their edits."""
    short = []
    for i, sequence in enumerate(sequences):
        for name in names:
            rows[i][name] = rows[i][name][: len(sequence)]
        if rows[i][names[0]].shape[0] < len(sequence):
            short.append(i)
    if not short:
        return
    _, last = run_requests(
        engine,
        architecture,
        [{"prompt_token_ids": sequences[i]} for i in short],
        [{"max_tokens": 1}] * len(short),
        names,
        {j: described[i] for j, i in enumerate(short) if i in described},
        edit_on=edit_on,
        tags=[{"prompt_length": len(outputs[i].prompt_token_ids)} for i in short],
        selection=in_workers,
    )
    for j, i in enumerate(short):
        for name in names:
            rows[i][name] = torch.cat([rows[i][name], last[j][name][-1:]])
