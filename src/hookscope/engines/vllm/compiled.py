"""vLLM's compiled mode (its default, without `enforce_eager`), with the user's consent.

No module hook runs inside vLLM's compiled graph: the graph was traced once, at the engine's start,
before any hook was attached, and runs without Python. So a compiled engine is refused by every
hookscope verb that needs module hooks, unless its maker consented to `hold_eager`, the compile
policy name hookscope gives to running a compiled region eagerly while hooks that cannot enter its
graph are attached (`hookscope.compiling.hold_eager`, on Hugging Face models):

    llm = hookscope.engines.vllm.llm(path, compile_policy="hold_eager")
    LLM(..., additional_config={"hookscope": {"compile": "hold_eager"}})
    vllm serve ... --additional-config '{"hookscope": {"compile": "hold_eager", ...}}'

The consent lives in the engine's own settings (`VllmConfig.additional_config`, where `vllm serve`
already takes hookscope's vectors and store), so it reaches the caller's checks, the server's plugin
and every worker alike, and is given once per engine rather than on each verb. With it, a worker
runs the model uncompiled for each forward that holds a request hookscope acts on (captured, edited,
steered by name, written to the server's store) and compiled for every other forward: vLLM's own
per-forward switch, `ForwardContext.skip_compiled`, set by hookscope's root pre-hook, which runs
before the compiled model's `__call__` reads it. vLLM makes a fresh forward context for every
forward, with the switch off, so nothing is left to turn back.

CUDA graphs (vLLM's default on a GPU) replay a recorded forward without running Python, so a
replayed forward would skip hookscope's root pre-hook and hooks both: consent is refused there
unless the engine is made with `compilation_config={"cudagraph_mode": "NONE"}` (compiled, no CUDA
graphs), the one layout whose hooked forwards are known to run hookscope's Python. Checked on the
CPU backend only (no GPU measured); `STOCK_TORCH_COMPILE`, whose compiled model vLLM's model runner
calls without that switch, is refused too.
"""

from __future__ import annotations

from typing import Any

from ...errors import EngineError

CONFIG_KEY = "hookscope"  # vLLM's additional_config entry hookscope reads (serve.py's too)
POLICY_KEY = "compile"
HOLD_EAGER = "hold_eager"
POLICIES = ("off", HOLD_EAGER)  # `llm(compile_policy=...)`: off is enforce_eager
# vLLM's compilation modes whose model reads `ForwardContext.skip_compiled` per forward (or, NONE,
# is not compiled at all)
SWITCHABLE_MODES = ("NONE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE")

CONSENT = (
    'hookscope.engines.vllm.llm(path, compile_policy="hold_eager"), '
    'LLM(..., additional_config={"hookscope": {"compile": "hold_eager"}}) or '
    '`vllm serve --additional-config \'{"hookscope": {"compile": "hold_eager"}}\'`'
)


def engine_options(compile_policy: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`vllm.LLM`'s keyword arguments `kwargs` under a hookscope compile policy: "off", eager
    (`enforce_eager=True` unless told); "hold_eager", vLLM's compiled mode with the consent."""
    if compile_policy not in POLICIES:
        raise EngineError(
            f"compile_policy={compile_policy!r} is not a compile policy of a vLLM engine: use "
            f'"off" (eager, the default) or "{HOLD_EAGER}" (vLLM compiles; the forwards that carry '
            "hookscope's hooks run uncompiled)"
        )
    options = dict(kwargs)
    if compile_policy == "off":
        options.setdefault("enforce_eager", True)
        return options
    options.setdefault("enforce_eager", False)
    extra = dict(options.get("additional_config") or {})
    extra[CONFIG_KEY] = {**(extra.get(CONFIG_KEY) or {}), POLICY_KEY: HOLD_EAGER}
    options["additional_config"] = extra
    return options


def runs_compiled(config) -> bool:
    """Whether an engine with this `VllmConfig` may run its model through vLLM's compiled graph."""
    return not config.model_config.enforce_eager


def consent(config) -> str | None:
    """The compile policy the engine's maker gave hookscope (None if none), checked."""
    settings = (config.additional_config or {}).get(CONFIG_KEY)
    policy = settings.get(POLICY_KEY) if isinstance(settings, dict) else None
    if policy is not None and policy != HOLD_EAGER:
        raise EngineError(
            f'additional_config {{"hookscope": {{"compile": {policy!r}}}}} is not a compile policy of a '
            f'vLLM engine: the one hookscope offers is "{HOLD_EAGER}"'
        )
    return policy


def check(config) -> None:
    """Refuse, naming the fixes, an engine whose compiled graph would run without hookscope's hooks."""
    if not runs_compiled(config):
        return
    if consent(config) is None:
        raise EngineError(
            "this engine runs vLLM's compiled graph, inside which module hooks do not run: make it with "
            "enforce_eager=True (hookscope.engines.vllm.llm does unless told; `vllm serve "
            "--enforce-eager`), or consent to hookscope running the forwards that carry its hooks "
            f"uncompiled while every other forward stays compiled: {CONSENT}"
        )
    compilation = config.compilation_config
    if compilation.mode.name not in SWITCHABLE_MODES:
        raise EngineError(
            f"compilation mode {compilation.mode.name}: vLLM's model runner compiles the whole model "
            "itself there, and hookscope cannot run a hooked forward uncompiled; use vLLM's default "
            "compilation mode or enforce_eager=True"
        )
    if compilation.cudagraph_mode.name != "NONE":
        raise EngineError(
            f"cudagraph_mode {compilation.cudagraph_mode.name}: a CUDA graph replays a forward without "
            "running Python, so hookscope's hooks would be skipped on a replayed forward; make the engine "
            'with compilation_config={"cudagraph_mode": "NONE"} (`vllm serve -cc.cudagraph_mode=NONE`) or '
            "enforce_eager=True"
        )


def holds_eager(config) -> bool:
    """Whether a worker of an engine with this `VllmConfig` runs hooked forwards uncompiled."""
    return runs_compiled(config) and consent(config) == HOLD_EAGER


def run_this_forward_uncompiled() -> None:
    """vLLM's switch for the forward about to run (its forward context's): the compiled model calls
    its Python `forward`, where hookscope's hooks run. The next forward's context starts with it off."""
    from vllm.forward_context import get_forward_context

    get_forward_context().skip_compiled = True
