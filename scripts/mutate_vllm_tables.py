"""Mutation run over hookscope's vLLM point tables (src/hookscope/engines/vllm/tables.py): every
entry pointed at a plausible wrong place (mutate_tables.py's rules: the other side of its module, a
neighbouring module, the parent, a child, the layer before) or read through a wrong view (the
fused residual not put back, q / k / v split one head off, the gate and up halves swapped, the
norm's centring flipped, the heads laid out wrong), and the family's tests run against each:
tests/engines/test_vllm_names.py's, test_vllm_moe.py's for the mixture-of-experts families.

One engine per family for the whole run, with the engine core and its worker in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0): the worker builds its table through `tables.table` when a
capture starts, so wrapping that function here swaps the table in the worker too, and each
mutant costs a few captures, not an engine start. A mutant the tests miss is checked for
equivalence (the wrong place holds the same tensors on that engine): those are listed apart.

    scripts/mutate-tables --vllm [FAMILY ...] [--rules GLOB ...] [--points GLOB ...]
                        (default: every family of tests/engines/vllm_models.py, MoE ones included,
                         every rule)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import fnmatch
import inspect
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests" / "kit"), str(ROOT / "tests" / "engines")]
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process: its table is ours to swap

import mutate_tables  # noqa: E402  (the module rules: where an entry may wrongly point)
import test_vllm_moe  # noqa: E402
import test_vllm_names  # noqa: E402
import torch  # noqa: E402
import vllm_models  # noqa: E402
from tqdm import tqdm  # noqa: E402

import hookscope as hs  # noqa: E402
from hookscope.arch.base import Call, View  # noqa: E402
from hookscope.engines import vllm as hv  # noqa: E402
from hookscope.engines.vllm import tables  # noqa: E402

# --- wrong views: each replaces one of tables.py's view makers while a table is built --------------

# tables.py's own view makers, kept before any is swapped (the wrong ones are built from them)
RIGHT = SimpleNamespace(
    **{
        name: getattr(tables, name)
        for name in ("stream_in", "STREAM_OUT", "RMS_NORMALIZED", "LN_NORMALIZED")
        + ("split_heads", "half", "heads", "fused_heads")
    }
)


def _shifted(part: int, sizes: tuple[int, int, int], n_heads: int) -> View:
    """q / k / v read one head off: q and k one head later, v one head earlier."""
    d_head = sizes[part] // n_heads
    start = sum(sizes[:part]) + (-d_head if part == 2 else d_head)
    return View(
        lambda raw: raw.narrow(-1, start, sizes[part]).unflatten(-1, (n_heads, -1)),
        RIGHT.split_heads(part, sizes, n_heads).put,
        "mutant: one head off",
        head_dim=-2,
    )


def _heads_transposed(n_heads: int) -> View:
    """[..., d_head * n_heads] read as if the heads were the inner dim."""
    return View(
        lambda raw: raw.unflatten(-1, (-1, n_heads)).transpose(-1, -2),
        RIGHT.heads(n_heads).put,
        "mutant: heads transposed",
        head_dim=-2,
    )


def _hidden_only(first: int) -> View:
    return View(lambda call: call.args[first], RIGHT.stream_in(first).put, "mutant: residual not put back")


def _normalized_without_residual(right: View, centred: bool) -> View:
    def get(call):
        return tables._normalized(Call(call.module, call.args[:1], {}), centred)

    return View(get, right.put, "mutant: normalized without the residual")


def _marked(view: View, what: str) -> View:
    return dataclasses.replace(view, label=f"mutant: {what}")


# rule -> {name in tables: its wrong stand-in}
VIEW_RULES = {
    "view:residual-not-put-back": {
        "stream_in": _hidden_only,
        "STREAM_OUT": View(lambda out: out[0], RIGHT.STREAM_OUT.put, "mutant: residual not put back"),
        "RMS_NORMALIZED": _normalized_without_residual(RIGHT.RMS_NORMALIZED, False),
    },
    "view:qkv-one-head-off": {"split_heads": _shifted},
    "view:qkv-parts-swapped": {
        "fused_heads": lambda part, n, h: _marked(RIGHT.fused_heads((part + 1) % n, n, h), "next part"),
        "split_heads": lambda part, sizes, h: _marked(
            RIGHT.split_heads((part + 1) % 3, sizes, h), "next part"
        ),
    },
    "view:gate-up-swapped": {"half": lambda part: _marked(RIGHT.half(1 - part), "other half")},
    "view:centring-flipped": {
        "RMS_NORMALIZED": _marked(RIGHT.LN_NORMALIZED, "centred"),
        "LN_NORMALIZED": _marked(RIGHT.RMS_NORMALIZED, "not centred"),
    },
    "view:heads-transposed": {"heads": _heads_transposed},
}


@contextlib.contextmanager
def _views_replaced(rule: str):
    saved = {name: getattr(tables, name) for name in VIEW_RULES[rule]}
    for name, wrong in VIEW_RULES[rule].items():
        setattr(tables, name, wrong)
    try:
        yield
    finally:
        for name, right in saved.items():
            setattr(tables, name, right)


# --- mutations -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Mutation:
    family: str  # the test case in vllm_models.FAMILIES
    key: str  # "blocks.*.attn.q" or a top-level name
    rule: str  # a mutate_tables rule ("io", "sibling:o_proj:input", ...) or a VIEW_RULES key

    def __str__(self) -> str:
        return f"{self.family}: {self.key} -> {self.rule}"


_ORIGINAL_TABLE = tables.table


def _wrong_view_table(rule: str, architecture: str, config):
    with _views_replaced(rule):
        return _ORIGINAL_TABLE(architecture, config)


def mutated_table(mutation: Mutation, architecture: str, config):
    """The family's table with the one entry moved or read through the wrong view."""
    arch = _ORIGINAL_TABLE(architecture, config)
    if mutation.rule in VIEW_RULES:
        wrong = _wrong_view_table(mutation.rule, architecture, config).specs
        moved = {n: wrong[n] for n in arch.specs if mutate_tables.key_of(n) == mutation.key}
    else:
        moved = {
            n: mutate_tables._moved(spec, arch, mutation)
            for n, spec in arch.specs.items()
            if mutate_tables.key_of(n) == mutation.key
        }
    arch.specs = {n: moved.get(n, spec) for n, spec in arch.specs.items()}
    return arch


@contextlib.contextmanager
def applied(mutation: Mutation):
    """`tables.table` (what the worker and the caller's checks both call) returns the mutant."""
    tables.table = lambda architecture, config: mutated_table(mutation, architecture, config)
    try:
        yield
    finally:
        tables.table = _ORIGINAL_TABLE


def mutations(family: str, llm) -> list[Mutation]:
    """Every mutation of the family's table whose wrong place exists in the engine's model."""
    architecture, arch = hv.check_engine(llm)
    model = llm.collective_rpc(lambda worker: worker._hookscope_model())[0]
    found: list[Mutation] = []
    seen: set[str] = set()
    for name, spec in arch.specs.items():
        key = mutate_tables.key_of(name)
        if key in seen:
            continue
        seen.add(key)
        for rule in mutate_tables.rules_for(spec, arch, model):
            target = mutate_tables.retarget(rule, spec, arch)
            if target and target != (spec.module, spec.io) and mutate_tables._exists(model, target[0]):
                found.append(Mutation(family, key, rule))
    config = llm.llm_engine.vllm_config.model_config.hf_config
    for rule in VIEW_RULES:
        wrong = _wrong_view_table(rule, architecture, config).specs
        keys = {mutate_tables.key_of(n) for n, s in wrong.items() if s.view and "mutant" in s.view.label}
        found += [Mutation(family, key, rule) for key in sorted(keys)]
    return found


# --- running the tests against a mutant ----------------------------------------------------------


def _tests(module) -> list:
    """A test module's tests that take an engine (its `family` fixture), called directly: pytest's
    start-up and a fresh engine per mutant would dominate."""
    return [
        f
        for name, f in vars(module).items()
        if name.startswith("test_") and "family" in inspect.signature(f).parameters
    ]


@dataclasses.dataclass(frozen=True)
class Suite:
    """The tests a family's table is held to, their prompts and their engine's settings."""

    tests: list
    prompts: list
    engine: dict


_NAMES = Suite(_tests(test_vllm_names), test_vllm_names.PROMPTS, {})
_MOE = Suite(_tests(test_vllm_moe), test_vllm_moe.PROMPTS, test_vllm_moe.ENGINE)
SUITES = {**dict.fromkeys(vllm_models.FAMILIES, _NAMES), **dict.fromkeys(vllm_models.MOE_FAMILIES, _MOE)}


def caught(mutation: Mutation, engine_case: tuple) -> str | None:
    """ "test" (a test's assertion failed), "error" (the wrong entry made hookscope or the
    engine raise), "equivalent" (the same tensors at the wrong place), or None (a survivor)."""
    with applied(mutation):
        for test in SUITES[mutation.family].tests:
            try:
                test(engine_case)
            except AssertionError:
                return "test"
            except Exception:
                return "error"
    return "equivalent" if equivalent(mutation, engine_case[2]) else None


def equivalent(mutation: Mutation, llm) -> bool:
    _, arch = hv.check_engine(llm)
    names = [n for n in arch.names if mutate_tables.key_of(n) == mutation.key]
    prompts = SUITES[mutation.family].prompts
    right = hs.collect(llm, prompts, names)
    with applied(mutation):  # the tests' own captures of these names ran, so this one runs too
        wrong = hs.collect(llm, prompts, names)
    return all(
        r[n].shape == w[n].shape and torch.equal(r[n], w[n])
        for r, w in zip(right, wrong, strict=True)
        for n in names
    )


def run(
    family: str, directory: Path, rules: list[str], points: list[str]
) -> tuple[collections.Counter, int, list[str], list[str]]:
    """Counts of caught mutations by what caught them, the number tried, survivors, equivalents."""
    suite = SUITES[family]
    llm = vllm_models.engine(directory, **suite.engine)
    try:
        found = [
            m
            for m in mutations(family, llm)
            if any(fnmatch.fnmatch(m.rule, r) for r in rules)
            and any(fnmatch.fnmatch(m.key, p) for p in points)
        ]
        for test in suite.tests:  # the table as it is passes, or no mutant's failure would mean anything
            test((family, directory, llm))
        by: collections.Counter = collections.Counter()
        survivors, same = [], []
        for mutation in tqdm(found, desc=f"{family} mutants", unit="mutant", leave=False):
            how = caught(mutation, (family, directory, llm))
            if how == "error":  # raised inside a forward: the engine's scheduler is left broken
                vllm_models.shut(llm)
                llm = vllm_models.engine(directory, **suite.engine)
            if how in (None, "equivalent"):
                (same if how else survivors).append(str(mutation))
                tqdm.write(f"    {how or 'SURVIVED'} {mutation}")  # as found: a long run may be cut short
            else:
                by[how] += 1
        return by, len(found) - len(same), survivors, same
    finally:
        vllm_models.shut(llm)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "families", nargs="*", help="cases of vllm_models.FAMILIES / MOE_FAMILIES (default: all)"
    )
    parser.add_argument(
        "--rules",
        nargs="+",
        default=["*"],
        help="only mutations whose rule matches one of these globs (e.g. 'view:*' io layer-1)",
    )
    parser.add_argument(
        "--points",
        nargs="+",
        default=["*"],
        help="only mutations of the entries whose name matches one of these globs (e.g. 'blocks.*.mlp.*')",
    )
    args = parser.parse_args()
    overall: collections.Counter = collections.Counter()
    total = 0
    with tempfile.TemporaryDirectory(prefix="hookscope-mutate-vllm-") as tmp:
        for family in args.families or list(SUITES):
            start = time.perf_counter()
            directory = vllm_models.save(family, Path(tmp) / family)
            by, n, survivors, same = run(family, directory, args.rules, args.points)
            overall, total = overall + by, total + n
            mutate_tables.report(
                f"{family:8s}", by, n, survivors, same, f"{time.perf_counter() - start:.0f} s", HOW
            )
    return mutate_tables.summary(overall, total, HOW)


HOW = ("test", "error")  # what caught a mutant, in the order reported


if __name__ == "__main__":
    sys.exit(main())
