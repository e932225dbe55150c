"""hookscope under `vllm serve`: steering vectors registered by name at start, asked for per request.

    VLLM_PLUGINS=hookscope vllm serve MODEL --enforce-eager --no-enable-prefix-caching \\
        --worker-extension-cls hookscope.engines.vllm.worker.Extension \\
        --logits-processors hookscope.engines.vllm.serve:RequestCheck \\
        --additional-config '{"hookscope": {"vectors": "vectors.safetensors"}}'

Three pieces of vLLM's plugin system, each given by name on the command line (`serve_flags`):

- `Plugin`, a `vllm.endpoint_plugins` entry point (pyproject.toml; vLLM loads one only when
  `VLLM_PLUGINS` names it): at start, in the API server, it reads the vectors file and registers
  each vector in the workers through the worker extension's `hookscope_steer`, the path
  `register_vector` takes; `GET /hookscope/vectors` lists them.
- `RequestCheck`, a logits processor that changes no logits: vLLM runs its `validate_params` in the
  API server on every request, so a request naming an unknown vector or a bad scale gets HTTP 400
  before it reaches the engine.
- The worker extension (worker.py), which adds each vector on its requests' tokens only, and, where
  the operator names a store and its points, writes the prompt rows of the requests that ask
  (`"hookscope.capture": 1`) into it (capture_store.py).

The vectors file is a safetensors file: each tensor a vector, `[d_model]`, named by its tensor name,
and the file's metadata maps that name to the point it is added at (`{"joy": "blocks.0.resid_post"}`).
A request asks for vectors in its `vllm_xargs`, one key per vector: `{"hookscope.steer.joy": 4.0}`.
Only names, numbers and a file path cross processes or the wire: nothing executable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import EngineError
from ...loading import sha256_text
from ...store.resume import plan_for
from . import EXTENSION, capture_store, check_config, check_version, resolve, steer_call
from .batch import CAPTURE_ID_KEY, CAPTURE_KEY, STEER_KEY, TAG, steering_asked

# vLLM's logits processor class is this module's base: without vLLM (or with another release) the
# import stops here, naming what to install
check_version()
from vllm.v1.sample.logits_processor import LogitsProcessor  # noqa: E402

CHECK = "hookscope.engines.vllm.serve:RequestCheck"
# vLLM's --additional-config: {"hookscope": {"vectors": path}}, and/or a store of captures:
# {"hookscope": {"store": dir, "points": [...], "shard_rows": n}} (capture_store.py, `store_call`)
CONFIG_KEY = "hookscope"
ROUTE = "/hookscope/vectors"

STORE_HOW = (
    'serve with --additional-config \'{"hookscope": {"store": "DIR", "points": ["blocks.1.resid_post"]}}\' '
    '(optionally "shard_rows": N, the rows of a shard; 65536 unless given)'
)


@dataclass(frozen=True)
class StoreOptions:
    """The store part of hookscope's `--additional-config`."""

    out: str
    points: list[str]
    shard_rows: int = 65536


def store_options(settings: dict[str, Any]) -> StoreOptions | None:
    """The store the operator asked for in hookscope's settings, checked; None if none."""
    out, points, shard_rows = settings.get("store"), settings.get("points"), settings.get("shard_rows", 65536)
    if out is None and points is None:
        return None
    if not isinstance(out, str) or not out:
        raise EngineError(f"hookscope's settings give points but no store directory: {STORE_HOW}")
    if isinstance(points, str):
        points = [p.strip() for p in points.split(",") if p.strip()]
    if not points or not isinstance(points, list) or not all(isinstance(p, str) for p in points):
        raise EngineError(f"hookscope's store {out!r} needs its points, a list of names: {STORE_HOW}")
    if isinstance(shard_rows, bool) or not isinstance(shard_rows, int) or shard_rows < 1:
        raise EngineError(
            f"hookscope's shard_rows must be a whole number >= 1, got {shard_rows!r}: {STORE_HOW}"
        )
    return StoreOptions(out, points, shard_rows)


def store_call(config, options: StoreOptions) -> tuple:
    """The arguments of the workers' `hookscope_serve_store` for a server with this `VllmConfig`:
    plain data, checked before any worker is called (the points, prefix caching, a grace period to
    stop in, and a store already in the directory made with other settings, refused with what
    differs)."""
    architecture, arch = check_config(config)
    if config.cache_config.enable_prefix_caching:
        # a prompt's cached tokens never run their forward, so their rows would be missing
        raise EngineError(
            "hookscope's store needs every prompt token's forward, which prefix caching skips for "
            "cached tokens: serve with --no-enable-prefix-caching"
        )
    if not config.shutdown_timeout:
        # vLLM's default (0) kills the workers at once when the server stops: the last shard is lost
        raise EngineError(
            "hookscope's store commits its last shard when the server stops, which vLLM allows only "
            f"with a grace period: serve with --shutdown-timeout {capture_store.SHUTDOWN_TIMEOUT} (seconds)"
        )
    names = list(resolve(arch, options.points).values())
    model = config.model_config
    settings = {
        "source": "vllm serve",
        "model": model.model,
        "model_class": architecture,
        "config_sha256": sha256_text(model.hf_config.to_json_string(use_diff=False)),
        "points": names,
        "dtype": str(model.dtype).removeprefix("torch."),
    }
    plan_for(options.out, settings, 1)  # a store of other settings: refused here, naming what differs
    return architecture, names, options.out, settings, options.shard_rows


def check_capture(params, store: str | None) -> None:
    """Raises ValueError (vLLM's HTTP 400) for a request asking for a capture this server cannot
    write: no store, `n` > 1 (whose rows would share one prompt), a malformed flag or capture id."""
    extra = params.extra_args or {}
    asked = extra.get(CAPTURE_KEY)
    if CAPTURE_KEY in extra and (isinstance(asked, float) or asked not in (0, 1)):
        raise ValueError(f'"{CAPTURE_KEY}" is 1 (capture this request) or 0, got {asked!r}')
    given = extra.get(CAPTURE_ID_KEY)
    if CAPTURE_ID_KEY in extra and (not asked or not isinstance(given, str) or not given):
        raise ValueError(
            f'"{CAPTURE_ID_KEY}" names a captured request\'s rows: a non-empty string, with '
            f'"{CAPTURE_KEY}": 1; got {given!r}'
        )
    if not asked:
        return
    if store is None:
        raise ValueError(
            f"this server writes no hookscope store, so it cannot capture a request: {STORE_HOW}"
        )
    if params.n > 1:
        raise ValueError(
            f"a captured request asks for one completion (n=1, got n={params.n}): its prompt's rows "
            "are filed once"
        )


def serve_flags(
    vectors: str | Path | None = None, *, store: str | Path | None = None, points: list[str] = (), **more: Any
) -> list[str]:
    """The `vllm serve` flags hookscope needs to serve the vectors of the file `vectors` and/or to
    write the captures of the requests that ask into the store `store` at `points` (with
    `VLLM_PLUGINS=hookscope` in the environment); `more`: other settings (`shard_rows`)."""
    import json

    settings: dict[str, Any] = {"vectors": str(vectors)} if vectors is not None else {}
    if store is not None:
        settings.update(store=str(store), points=list(points), **more)
    return [
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--worker-extension-cls",
        EXTENSION,
        "--logits-processors",
        CHECK,
        "--additional-config",
        json.dumps({CONFIG_KEY: settings}),
        *(("--shutdown-timeout", str(capture_store.SHUTDOWN_TIMEOUT)) if store is not None else ()),
    ]


def read_vectors(path: str | Path) -> dict[str, tuple[str, torch.Tensor]]:
    """{name: (point, vector)} from a safetensors file: tensor name = vector name, the file's
    metadata maps each name to its point. Raises EngineError naming what is wrong and the fix."""
    from safetensors import SafetensorError, safe_open

    how = "write it with safetensors.torch.save_file({name: vector, ...}, path, metadata={name: point, ...})"
    if not Path(path).is_file():
        raise EngineError(f"no vectors file {str(path)!r}: {how}")
    try:
        with safe_open(str(path), framework="pt") as f:
            points = f.metadata() or {}
            vectors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
    except SafetensorError as e:
        raise EngineError(f"{str(path)!r} is not a safetensors file ({e}): {how}") from e
    if not vectors:
        raise EngineError(f"{str(path)!r} holds no vectors: {how}")
    unplaced = sorted(set(vectors) - set(points))
    if unplaced:
        raise EngineError(f"{str(path)!r} gives no point for {', '.join(unplaced)}: {how}")
    flat = sorted(name for name, v in vectors.items() if v.dim() != 1)
    if flat:
        raise EngineError(
            f"{', '.join(flat)} in {str(path)!r} are not vectors (one dimension, d_model): {how}"
        )
    return {name: (points[name], vector.float()) for name, vector in vectors.items()}


def check_request(extra: dict[str, Any] | None, known: dict[str, str]) -> None:
    """Raises ValueError (vLLM's HTTP 400) for a request's extra arguments that name a vector this
    server lacks, give a scale that is not a finite number, or are a hookscope key of no known shape."""
    listing = ", ".join(sorted(known)) or "none"
    for key in extra or {}:
        ours = key in (TAG, CAPTURE_KEY, CAPTURE_ID_KEY) or key.startswith(STEER_KEY)
        if key.startswith(TAG) and not ours:
            raise ValueError(
                f"unknown hookscope argument {key!r}: ask for a vector with "
                f'"{STEER_KEY}<name>": scale in vllm_xargs (this server\'s vectors: {listing})'
            )
    for name, scale in steering_asked(extra):
        if not known:
            raise ValueError(
                f"this server has no steering vectors, so {name!r} cannot be applied: start it with "
                "VLLM_PLUGINS=hookscope and the flags of hookscope.engines.vllm.serve.serve_flags"
            )
        if name not in known:
            raise ValueError(
                f"unknown steering vector {name!r}: this server has {listing} (GET {ROUTE} lists them)"
            )
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
            raise ValueError(
                f"the scale of steering vector {name!r} must be a finite number, got {scale!r}: "
                f'e.g. "{STEER_KEY}{name}": 4.0'
            )


class RequestCheck(LogitsProcessor):
    """Checks each request's hookscope arguments in the API server (`validate_params`); in the
    workers it leaves the logits as they are."""

    # name -> point, filled at start by `Plugin.init_state` in this API server process
    known: dict[str, str] = {}
    store: str | None = None  # where the workers write the captures requests ask for, if anywhere

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        check_request(sampling_params.extra_args, cls.known)
        check_capture(sampling_params, cls.store)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass


def plugin_settings(config) -> dict[str, Any]:
    """hookscope's `--additional-config` settings (a vectors file, a store, or both), the flags
    checked first."""
    processors = config.model_config.logits_processors or ()
    if not any(p == CHECK or p is RequestCheck for p in processors):
        raise EngineError(
            f"hookscope's plugin checks each request's vectors before the engine sees it: serve with "
            f"--logits-processors {CHECK} (hookscope.engines.vllm.serve.serve_flags lists every flag)"
        )
    settings = (config.additional_config or {}).get(CONFIG_KEY)
    if not isinstance(settings, dict) or not ({"vectors", "store", "points"} & set(settings)):
        raise EngineError(
            "hookscope's plugin serves the vectors of a file and/or writes captures to a store: serve with "
            f'--additional-config \'{{"{CONFIG_KEY}": {{"vectors": "vectors.safetensors"}}}}\' '
            f"or {STORE_HOW.removeprefix('serve with ')}"
        )
    return settings


class Plugin:
    """vLLM's endpoint plugin (`vllm.endpoint_plugins` entry point `hookscope`)."""

    name = "hookscope"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        @app.get(ROUTE)
        async def vectors() -> dict[str, str]:
            """The steering vectors this server registered: {name: point}."""
            return dict(RequestCheck.known)

    async def init_state(self, engine_client, state, args) -> None:
        if engine_client is None:  # vLLM's render-only server: no engine, no workers
            return
        config = engine_client.vllm_config
        settings = plugin_settings(config)
        # every vector and the store checked before the first worker call
        vectors = read_vectors(settings["vectors"]).items() if "vectors" in settings else ()
        calls = [steer_call(config, name, point, v) for name, (point, v) in vectors]
        store = store_options(settings)
        store_args = store_call(config, store) if store is not None else None
        for call in calls:
            await engine_client.collective_rpc("hookscope_steer", args=call)
        if store_args is not None:
            await engine_client.collective_rpc("hookscope_serve_store", args=store_args)
        RequestCheck.known = {name: point for _, name, point, _ in calls}
        RequestCheck.store = store.out if store is not None else None
