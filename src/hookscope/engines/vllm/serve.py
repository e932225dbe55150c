"""hookscope under `vllm serve`: steering vectors and ablations registered by name at start, asked
for per request.

    VLLM_PLUGINS=hookscope vllm serve MODEL --enforce-eager --no-enable-prefix-caching \\
        --worker-extension-cls hookscope.engines.vllm.worker.Extension \\
        --logits-processors hookscope.engines.vllm.serve:RequestCheck \\
        --additional-config '{"hookscope": {"vectors": "vectors.safetensors"}}'

Three pieces of vLLM's plugin system, each given by name on the command line (`serve_flags`):

- `Plugin`, a `vllm.endpoint_plugins` entry point (pyproject.toml; vLLM loads one only when
  `VLLM_PLUGINS` names it): at start, in the API server, it reads the vectors file and registers
  each vector and ablation in the workers as a named edit (the worker extension's
  `hookscope_name_edit`, the path `register_vector` takes); `GET /hookscope/vectors` and
  `GET /hookscope/ablations` list them.
- `RequestCheck`, a logits processor that changes no logits: vLLM runs its `validate_params` in the
  API server on every request, so a request naming an unknown vector or a bad scale gets HTTP 400
  before it reaches the engine.
- The worker extension (worker.py), whose one edit path (edits.py) applies each request's named
  edits on its own tokens only, as `hs.steer` / `hs.ablate` on that request alone, and, where the
  operator names a store and its points, writes the rows of the requests that ask
  (`"hookscope.capture": 1`), prompt and generated tokens, into it (capture_store.py).

On an engine in vLLM's compiled mode (no `--enforce-eager`), hookscope's settings carry the consent
`"compile": "hold_eager"` (compiled.py; `serve_flags(..., compile_policy="hold_eager")` writes them).

The vectors file is a safetensors file: each tensor named by its tensor name, the file's metadata
mapping that name to what it is. A steering vector is `[d_model]` floats, its metadata the point it
is added at (`{"joy": "blocks.0.resid_post"}`); an ablation is a 1-D integer tensor of the heads it
zeroes (empty: the whole point), its metadata `"ablate:<point>"` (`{"no_head_1":
"ablate:blocks.0.attn.z"}`). A request asks in its `vllm_xargs`, one key per edit:
`{"hookscope.steer.joy": 4.0}` (the scale), `{"hookscope.ablate.no_head_1": 1}` (1 or true: ablate;
0 or false: leave it out). Only names, numbers and a file path cross processes or the wire: nothing
executable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...edit import Edit, ablate, steer
from ...errors import EngineError
from ...loading import sha256_text
from ...store.resume import plan_for
from . import EXTENSION, capture_store, check_config, check_version, compiled, named_edit_call, resolve
from .batch import ABLATE_KEY, CAPTURE_ID_KEY, CAPTURE_KEY, STEER_KEY, TAG, named_asked
from .compiled import CONFIG_KEY
from .worker import raise_refusals

# vLLM's logits processor class is this module's base: without vLLM (or with another release) the
# import stops here, naming what to install
check_version()
from vllm.v1.sample.logits_processor import LogitsProcessor  # noqa: E402

CHECK = "hookscope.engines.vllm.serve:RequestCheck"
# hookscope's entry of vLLM's --additional-config (CONFIG_KEY): {"hookscope": {"vectors": path}}, and/or
# a store of captures: {"hookscope": {"store": dir, "points": [...], "shard_rows": n, "generated": bool}}
# (capture_store.py, `store_call`); {"hookscope": {"compile": "hold_eager"}} serves vLLM's compiled mode
# (compiled.py)
ROUTE = "/hookscope/vectors"
ABLATIONS_ROUTE = "/hookscope/ablations"
ABLATE = "ablate:"  # the metadata of an ablation in the vectors file: "ablate:<point>"

STORE_HOW = (
    'serve with --additional-config \'{"hookscope": {"store": "DIR", "points": ["blocks.1.resid_post"]}}\' '
    '(optionally "shard_rows": N, the rows of a shard, 65536 unless given; "generated": false, the '
    "prompt's rows only)"
)


@dataclass(frozen=True)
class StoreOptions:
    """The store part of hookscope's `--additional-config`."""

    out: str
    points: list[str]
    shard_rows: int = 65536
    generated: bool = True  # the generated tokens' rows too, not only the prompt's


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
    generated = settings.get("generated", True)
    if not isinstance(generated, bool):
        raise EngineError(
            f"hookscope's generated is true (the generated tokens' rows too) or false, got {generated!r}: "
            f"{STORE_HOW}"
        )
    return StoreOptions(out, points, shard_rows, generated)


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
        "generated": options.generated,
    }
    plan_for(options.out, settings, 1)  # a store of other settings: refused here, naming what differs
    return architecture, names, options.out, settings, options.shard_rows, options.generated


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
    vectors: str | Path | None = None,
    *,
    store: str | Path | None = None,
    points: list[str] = (),
    compile_policy: str = "off",
    **more: Any,
) -> list[str]:
    """The `vllm serve` flags hookscope needs to serve the vectors of the file `vectors` and/or to
    write the captures of the requests that ask into the store `store` at `points` (with
    `VLLM_PLUGINS=hookscope` in the environment); `compile_policy` as `llm`'s ("hold_eager": vLLM's
    compiled mode, hooked forwards uncompiled); `more`: other settings (`shard_rows`)."""
    import json

    settings: dict[str, Any] = {"vectors": str(vectors)} if vectors is not None else {}
    if store is not None:
        settings.update(store=str(store), points=list(points), **more)
    options = compiled.engine_options(compile_policy, {"additional_config": {CONFIG_KEY: settings}})
    return [
        *(["--enforce-eager"] if options["enforce_eager"] else []),
        "--no-enable-prefix-caching",
        "--worker-extension-cls",
        EXTENSION,
        "--logits-processors",
        CHECK,
        "--additional-config",
        json.dumps(options["additional_config"]),
        *(("--shutdown-timeout", str(capture_store.SHUTDOWN_TIMEOUT)) if store is not None else ()),
    ]


def read_vectors(path: str | Path) -> dict[str, Edit]:
    """{name: edit} from a safetensors file: tensor name = edit name, the file's metadata maps each
    name to its point (a steering vector, `[d_model]` floats) or to "ablate:<point>" (an ablation of
    the heads a 1-D integer tensor lists, of the whole point where it is empty). Raises EngineError
    naming what is wrong and the fix."""
    from safetensors import SafetensorError, safe_open

    how = (
        "write it with safetensors.torch.save_file({name: vector or head indices, ...}, path, "
        'metadata={name: point or "ablate:<point>", ...})'
    )
    if not Path(path).is_file():
        raise EngineError(f"no vectors file {str(path)!r}: {how}")
    try:
        with safe_open(str(path), framework="pt") as f:
            points = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
    except SafetensorError as e:
        raise EngineError(f"{str(path)!r} is not a safetensors file ({e}): {how}") from e
    if not tensors:
        raise EngineError(f"{str(path)!r} holds no vectors: {how}")
    unplaced = sorted(set(tensors) - set(points))
    if unplaced:
        raise EngineError(f"{str(path)!r} gives no point for {', '.join(unplaced)}: {how}")
    flat = sorted(name for name, v in tensors.items() if v.dim() != 1)
    if flat:
        raise EngineError(
            f"{', '.join(flat)} in {str(path)!r} are not vectors (one dimension, d_model): {how}"
        )
    return {name: _named_edit(name, points[name], t, how) for name, t in tensors.items()}


def _named_edit(name: str, meaning: str, tensor: torch.Tensor, how: str) -> Edit:
    if not meaning.startswith(ABLATE):
        return steer(meaning, tensor.float())
    if tensor.is_floating_point():
        raise EngineError(
            f"ablation {name!r} holds {tensor.dtype} values: it lists the heads it zeroes as integers "
            f"(an empty tensor: the whole point): {how}"
        )
    heads = tensor.tolist()
    return ablate(meaning.removeprefix(ABLATE), heads=heads or None)


def check_request(extra: dict[str, Any] | None, known: dict[str, str], ablations: dict[str, str]) -> None:
    """Raises ValueError (vLLM's HTTP 400) for a request's extra arguments that name a vector or
    ablation this server lacks, give a scale that is not a finite number or an ablation's value
    other than 1 / 0, or are a hookscope key of no known shape."""
    listing = ", ".join(sorted(known)) or "none"
    ablation_listing = ", ".join(sorted(ablations)) or "none"
    both = f"(this server's vectors: {listing}; ablations: {ablation_listing})"
    for key in extra or {}:
        ours = key in (TAG, CAPTURE_KEY, CAPTURE_ID_KEY) or key.startswith((STEER_KEY, ABLATE_KEY))
        if key.startswith(TAG) and not ours:
            raise ValueError(
                f"unknown hookscope argument {key!r}: ask for a vector with "
                f'"{STEER_KEY}<name>": scale or an ablation with "{ABLATE_KEY}<name>": 1 in vllm_xargs {both}'
            )
    for name, scale in named_asked(extra, "steer"):
        if not known:
            raise ValueError(
                f"this server has no steering vectors, so {name!r} cannot be applied: start it with "
                "VLLM_PLUGINS=hookscope and the flags of hookscope.engines.vllm.serve.serve_flags"
            )
        if name not in known:
            raise ValueError(
                f"unknown steering vector {name!r}: this server has {listing} (GET {ROUTE}) {both}"
            )
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
            raise ValueError(
                f"the scale of steering vector {name!r} must be a finite number, got {scale!r}: "
                f'e.g. "{STEER_KEY}{name}": 4.0'
            )
    for name, on in named_asked(extra, "ablate"):
        if name not in ablations:
            raise ValueError(
                f"unknown ablation {name!r}: this server has {ablation_listing} (GET {ABLATIONS_ROUTE} lists "
                f"them; its steering vectors: {listing})"
            )
        if on not in (0, 1):  # (True and False are 1 and 0)
            raise ValueError(
                f"ablation {name!r} takes 1 (ablate) or 0 (leave it out), got {on!r}: "
                f'e.g. "{ABLATE_KEY}{name}": 1'
            )


class RequestCheck(LogitsProcessor):
    """Checks each request's hookscope arguments in the API server (`validate_params`); in the
    workers it leaves the logits as they are."""

    # name -> point of the vectors and of the ablations, filled at start by `Plugin.init_state` in
    # this API server process
    known: dict[str, str] = {}
    ablations: dict[str, str] = {}
    store: str | None = None  # where the workers write the captures requests ask for, if anywhere

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        check_request(sampling_params.extra_args, cls.known, cls.ablations)
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

        @app.get(ABLATIONS_ROUTE)
        async def ablations() -> dict[str, str]:
            """The ablations this server registered: {name: point}."""
            return dict(RequestCheck.ablations)

    async def init_state(self, engine_client, state, args) -> None:
        if engine_client is None:  # vLLM's render-only server: no engine, no workers
            return
        config = engine_client.vllm_config
        settings = plugin_settings(config)
        # every vector, ablation and the store checked before the first worker call
        named = read_vectors(settings["vectors"]).items() if "vectors" in settings else ()
        calls = [named_edit_call(config, name, edit) for name, edit in named]
        store = store_options(settings)
        store_args = store_call(config, store) if store is not None else None
        for call in calls:
            raise_refusals(await engine_client.collective_rpc("hookscope_name_edit", args=call))
        if store_args is not None:
            await engine_client.collective_rpc("hookscope_serve_store", args=store_args)
        points = {kind: {} for kind in ("Steer", "Ablate")}
        for _, name, described in calls:
            points[described["kind"]][name] = described["fields"]["point"]
        RequestCheck.known, RequestCheck.ablations = points["Steer"], points["Ablate"]
        RequestCheck.store = store.out if store is not None else None
