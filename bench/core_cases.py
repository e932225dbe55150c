"""One configuration of the core benchmarks, run in the current (fresh) process.

    python bench/core_cases.py CASE --runs 7 [--budget 0.2] [--memory]

prints one JSON line: per-run timings (and, with --memory, per-run peak extra RSS). Cases:
  a.<tool>.<shape>   attach + remove one hook; tool: torch | hookscope | tl3 | tl4 (add_hook + reset_hooks)
                     | tl3_point | tl4_point (HookPoint.add_hook + remove_hooks); shape: see hook_shapes
  b.<config>         capture blocks.5.resid_post of GPT-2-small shape, 8 x 128 tokens (tl4_*: on a
                     TransformerLens 4 TransformerBridge over the same model: hookscope, run_with_cache)
  c.<config>         full forward, no hooks vs 12 no-op hookscope hooks
  small.<config>     1 x 16 tokens on a tiny GPT-2, where per-call overhead dominates; small.paired:
                     plain / hook / capture / collect taking turns in one process (--runs rounds
                     of --calls calls), with each one's ratio to plain in the same round
  check, check.tl4   all ways of taking blocks.5.resid_post agree (run once, before timing)
  versions           library versions of this interpreter
  prepare            build the cached models in bench/out/ (once)
bench_core.py runs them all side by side; this file only knows how to run one.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

POINT, TL_POINT, LAYER = "blocks.5.resid_post", "blocks.5.hook_resid_post", 5
SMALL_POINT = "blocks.1.resid_post"


# --- a: attach + remove ----------------------------------------------------------------------


def attach_remove_op(tool: str, shape: str) -> tuple[Callable[[], None], Any]:
    """The operation timed in benchmark a, and the model it acts on."""
    from hook_shapes import make_hook

    import hookscope as hs

    fn = make_hook(shape)
    if tool == "hookscope":
        model = common.load_hf()

        def op() -> None:
            with hs.hooks(model) as h:
                h.forward(POINT, fn)
    elif tool == "torch":
        model = common.load_hf()
        block = model.transformer.h[LAYER]

        def op() -> None:
            block.register_forward_hook(fn).remove()
    elif tool in ("tl3", "tl4"):  # the model-level API
        model = common.load_tl3() if tool == "tl3" else common.load_tl4()

        def op() -> None:
            model.add_hook(TL_POINT, fn)
            model.reset_hooks()
    elif tool in ("tl3_point", "tl4_point"):  # one HookPoint, no model-wide sweep
        model = common.load_tl3() if tool == "tl3_point" else common.load_tl4()
        point = model.hook_dict[TL_POINT]

        def op() -> None:
            point.add_hook(fn)
            point.remove_hooks()
    else:
        raise SystemExit(f"unknown tool {tool!r}")
    return op, model


def run_attach(tool: str, shape: str, runs: int, budget: float) -> dict:
    from hookscope.hooks import hook_count

    op, model = attach_remove_op(tool, shape)
    before = hook_count(model)
    per_op = common.per_op_us(op, batches=runs, budget_s=budget)
    assert hook_count(model) == before, "the attach/remove cycle left a hook behind"
    return {"us_per_op": per_op}


# --- b: capture one point --------------------------------------------------------------------


def floor_blocks(model, ids, last: int = LAYER):
    """Embeddings and blocks 0..last by hand on the Hugging Face modules, with the causal mask
    the model itself builds. (transformers 5.x blocks return a tensor, not a tuple.)"""
    import torch
    from transformers.masking_utils import create_causal_mask

    tr = model.transformer
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    embeds = tr.wte(ids)
    hidden = embeds + tr.wpe(positions)
    mask = create_causal_mask(
        config=tr.config,
        inputs_embeds=embeds,
        attention_mask=None,
        past_key_values=None,
        position_ids=positions,
    )
    hidden = tr.drop(hidden)
    for block in tr.h[: last + 1]:
        hidden = block(hidden, None, mask, position_ids=positions)
    return hidden


def forward_hook_capture(model, ids):
    """A plain register_forward_hook on block 5 and a full forward pass."""
    kept = {}
    handle = model.transformer.h[LAYER].register_forward_hook(lambda m, a, out: kept.__setitem__("x", out))
    try:
        model(ids)
    finally:
        handle.remove()
    return kept["x"]


def nnsight_capture(wrapped, ids, stop: bool):
    with wrapped.trace(ids) as tracer:
        saved = wrapped.transformer.h[LAYER].output.save()
        if stop:
            tracer.stop()
    return saved


def capture_fn(config: str) -> Callable[[], Any]:
    """A zero-argument call that returns blocks.5.resid_post, as each configuration takes it.
    Peers run under torch.inference_mode, as hookscope does by default."""
    import torch

    import hookscope as hs

    def inference(fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with torch.inference_mode():
                return fn()

        return run

    if config.startswith("tl4_"):  # TransformerLens 4.x: the bridge over the same saved model
        model = common.load_tl4()
        ids = common.input_ids(model.cfg.d_vocab)
        if config == "tl4_hookscope":
            return lambda: hs.collect(model, ids, POINT)[POINT]
        options = {
            "tl4_full": {},
            "tl4_filter": {"names_filter": TL_POINT},
            "tl4_filter_stop": {"names_filter": TL_POINT, "stop_at_layer": LAYER + 1},
        }[config]
        return inference(lambda: model.run_with_cache(ids, **options)[1][TL_POINT])
    if config.startswith("tl3_"):
        model = common.load_tl3()
        ids = common.input_ids(model.cfg.d_vocab)
        options = {
            "tl3_full": {},
            "tl3_filter": {"names_filter": TL_POINT},
            "tl3_filter_stop": {"names_filter": TL_POINT, "stop_at_layer": LAYER + 1},
        }[config]
        return inference(lambda: model.run_with_cache(ids, **options)[1][TL_POINT])
    model = common.load_hf()
    ids = common.input_ids(model.config.vocab_size)
    if config == "floor":
        return inference(lambda: floor_blocks(model, ids))
    if config == "hookscope":
        return lambda: hs.collect(model, ids, POINT)[POINT]
    if config == "forward_hook":
        return inference(lambda: forward_hook_capture(model, ids))
    if config in ("nnsight", "nnsight_stop"):
        from nnsight import NNsight

        wrapped = NNsight(model)
        return inference(lambda: nnsight_capture(wrapped, ids, stop=config == "nnsight_stop"))
    raise SystemExit(f"unknown capture config {config!r}")


def run_capture(config: str, runs: int, memory: bool) -> dict:
    fn = capture_fn(config)
    if memory:
        fn()  # warm-up: one-time caches are not the cost of a capture
        return {"peak_extra_bytes": [common.peak_extra_rss(fn) for _ in range(runs)]}
    return {"seconds": common.time_runs(fn, runs)}


def run_check(tl4: bool = False) -> dict:
    """Every configuration of b returns the same activation (TransformerLens within float
    rounding: it computes attention its own way). `tl4`: the bridge's configurations, run by the
    TransformerLens 4 interpreter."""
    import torch

    results = {}
    reference = capture_fn("floor")()
    assert isinstance(reference, torch.Tensor) and reference.shape == (common.BATCH, common.SEQ, 768)
    if tl4:
        configs = ["tl4_hookscope", "tl4_filter", "tl4_filter_stop"]
    else:
        configs = ["hookscope", "forward_hook", "tl3_filter_stop"]
        try:
            import nnsight  # noqa: F401

            configs += ["nnsight_stop"]
        except ImportError:
            results["nnsight"] = "not installed"
    for config in configs:
        value = capture_fn(config)()
        diff = (value - reference).abs().max().item()
        assert diff < 1e-4, f"{config} differs from the floor by {diff}"
        results[config] = diff
    return {"max_abs_diff_vs_floor": results}


# --- c and small: forward-pass overhead -------------------------------------------------------


def run_forward(config: str, runs: int) -> dict:
    import torch
    from hook_shapes import noop

    import hookscope as hs

    model = common.load_hf()
    ids = common.input_ids(model.config.vocab_size)
    if config == "paired":
        return run_forward_paired(model, ids, pairs=2 * runs)
    with hs.hooks(model) as h, torch.inference_mode():
        if config == "hooks12":
            for layer in range(model.config.n_layer):
                h.forward(f"blocks.{layer}.resid_post", noop)
        elif config != "none":
            raise SystemExit(f"unknown forward config {config!r}")
        return {"seconds": common.time_runs(lambda: model(ids), runs)}


def run_forward_paired(model, ids, pairs: int) -> dict:
    """Both configurations of c in one process, alternating (the order flips every pair).

    Separate processes of the same configuration differ by up to ~15% on this machine (process
    medians of the plain forward: 1,163-1,377 ms in one run), a fixed offset per process that
    5 runs each cannot average out. Pairing cancels it: each pair's ratio compares two forwards
    made back to back with the same memory layout."""
    import torch
    from hook_shapes import noop

    import hookscope as hs

    def forward(hooked: bool) -> float:
        with hs.hooks(model) as h, torch.inference_mode():
            if hooked:
                for layer in range(model.config.n_layer):
                    h.forward(f"blocks.{layer}.resid_post", noop)
            return common.time_runs(lambda: model(ids), runs=1, warmup=0)[0]

    forward(False), forward(True)  # warm-up
    none, hooked = [], []
    for pair in range(pairs):
        for is_hooked in (False, True) if pair % 2 == 0 else (True, False):
            (hooked if is_hooked else none).append(forward(is_hooked))
    return {
        "pair_ratios": [h / n for h, n in zip(hooked, none, strict=True)],
        "seconds_none": none,
        "seconds_hooks12": hooked,
    }


def small_fn(config: str, model: Any = None) -> Callable[[], Any]:
    """The call timed for a small configuration ("hook" attaches its hook unless given `model`,
    whose hooks the caller then owns)."""
    import torch
    from hook_shapes import noop

    import hookscope as hs
    from hookscope.hooks import add_hook

    given, model = model is not None, model if model is not None else common.load_hf(common.TINY_DIR)
    ids = common.input_ids(model.config.vocab_size, batch=1, seq=16)

    def plain() -> Any:
        with torch.inference_mode():
            return model(ids)

    if config in ("plain", "hook"):
        if config == "hook" and not given:  # attached for the life of the process: only the firing is timed
            add_hook(model, SMALL_POINT, noop)
        return plain
    if config == "capture":  # attach, full pass, detach: per call

        def capture() -> Any:
            with hs.capture(model, SMALL_POINT) as cap:
                model(ids)
            return cap[SMALL_POINT]

        return capture
    if config == "collect":  # stops after the point
        return lambda: hs.collect(model, ids, SMALL_POINT)
    if config in ("nnsight", "nnsight_stop"):
        from nnsight import NNsight

        wrapped = NNsight(model)
        layer = int(SMALL_POINT.split(".")[1])

        def trace() -> Any:
            with torch.inference_mode(), wrapped.trace(ids) as tracer:
                saved = wrapped.transformer.h[layer].output.save()
                if config == "nnsight_stop":
                    tracer.stop()
            return saved

        return trace
    raise SystemExit(f"unknown small config {config!r}")


def run_small_paired(rounds: int, calls: int) -> dict:
    """The small configurations on one model in one process, taking turns in rounds of `calls`
    calls (the order rotates every round), wall clock, one thread. Per configuration: its
    microseconds per call in each round, and the median over rounds of its time over the plain
    forward's in the same round.

    Processes of one configuration differ by up to ~12% in the plain forward's time on this machine
    (a fixed offset per process: memory layout, which core), more than the 5% asked of a capture;
    timed in processes of their own, a ratio's two sides carry two offsets. Here they share one."""
    import gc
    import time

    import torch
    from hook_shapes import noop

    from hookscope.hooks import add_hook

    # one intra-op thread: on a loaded machine a second one makes each 0.7 ms forward wait for it to
    # be scheduled (30 ms calls seen at load 8), and at 1 x 16 tokens the work is Python anyway
    torch.set_num_threads(1)
    model = common.load_hf(common.TINY_DIR)
    fns = {name: small_fn(name, model) for name in ("plain", "hook", "capture", "collect")}
    names = list(fns)  # "hook": the plain call, with one noop hook attached for its rounds only
    for _ in range(100):  # warm-up: the first calls build caches no later call pays
        for fn in fns.values():
            fn()
    per_call: dict[str, list[float]] = {name: [] for name in names}
    for rnd in range(rounds):
        shift = rnd % len(names)
        for name in names[shift:] + names[:shift]:
            hook = add_hook(model, SMALL_POINT, noop) if name == "hook" else None
            fn = fns[name]
            gc.collect()
            start = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            per_call[name].append((time.perf_counter_ns() - start) / calls / 1e3)
            if hook is not None:
                hook.remove()
    out: dict[str, Any] = {f"us_{name}": per_call[name] for name in names}
    for name in names[1:]:
        ratios = [a / b for a, b in zip(per_call[name], per_call["plain"], strict=True)]
        out[f"ratio_{name}"] = [common.median(ratios)]  # one per process: before_after pools them
    return out


# --- entry point -----------------------------------------------------------------------------


def versions() -> dict:
    found = {"python": sys.version.split()[0]}
    for dist in ("torch", "transformers", "transformer-lens", "nnsight", "hookscope"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    import hookscope

    found["hookscope_file"] = hookscope.__file__  # which source tree this process runs (--src)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("case")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--budget", type=float, default=0.2, help="seconds per timed batch of fast ops")
    parser.add_argument("--calls", type=int, default=50, help="small.paired: calls per round")
    parser.add_argument("--memory", action="store_true", help="measure peak extra RSS instead of time")
    args = parser.parse_args()
    common.setup_process()
    section, _, config = args.case.partition(".")
    if section == "a":
        tool, _, shape = config.partition(".")
        result = run_attach(tool, shape, args.runs, args.budget)
    elif section == "b":
        result = run_capture(config, args.runs, args.memory)
    elif section == "c":
        result = run_forward(config, args.runs)
    elif args.case == "small.paired":
        result = run_small_paired(rounds=args.runs, calls=args.calls)
    elif section == "small":
        result = {"us_per_op": common.per_op_us(small_fn(config), batches=args.runs, budget_s=args.budget)}
    elif section == "check":
        result = run_check(tl4=config == "tl4")
    elif section == "versions":
        result = versions()
    elif section == "prepare":
        common.ensure_models()
        result = {"models": [str(common.GPT2_SMALL_DIR), str(common.TINY_DIR)]}
    else:
        raise SystemExit(f"unknown case {args.case!r}")
    common.emit(result)


if __name__ == "__main__":
    main()
