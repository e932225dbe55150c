"""Mutation run over the family tables (src/hookscope/arch/): point one table entry at a plausible
wrong place (the other side of its module, a neighbouring module on either side, the parent,
a child, the layer before), run the relation tests and the family's own tests for every tiny
model that table covers, and count the mutations the tests catch.

The tables are never edited: each mutation wraps the family's `table()` in this process (the
wrapper swaps one entry's module / side in the Arch it returns) and is undone before the next.
A mutation the tests miss is checked for equivalence (the wrong place holds the same tensor on
every model, e.g. a block's input and its first norm's input): those are listed apart.

    scripts/mutate-tables [TABLE ...]     (default: every table; e.g. `vit clip`)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import io
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the tests' shared helpers (tests/kit) and the family tests' room (test_relations is called directly)
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests" / "kit"), str(ROOT / "tests" / "families")]

import family_models  # noqa: E402
import pytest  # noqa: E402
import test_relations  # noqa: E402
import torch  # noqa: E402

import hookscope as hs  # noqa: E402
from hookscope.arch import _BY_MODEL_TYPE, arch_of  # noqa: E402

# the family's own tests (beside tests/families/test_relations.py), per table
FAMILY_TESTS = {
    "gpt2": ["tests/core/test_capture.py", "-k", "every_point_equals_plain_hooks and gpt2"],
    "llama": ["tests/core/test_capture.py", "-k", "every_point_equals_plain_hooks and llama"],
    "gpt_neox": ["tests/core/test_capture.py", "-k", "every_point_equals_plain_hooks and neox"],
    "bert": ["tests/core/test_capture.py", "-k", "every_point_equals_plain_hooks and (bert or minilm)"],
    "moe": [
        "tests/families/test_families_moe.py",
        "-k",
        "points_equal or expert_points_equal or router_equals",
    ],
    "vit": ["tests/families/test_families_vision.py", "-k", "every_point and vit"],
    "clip": ["tests/families/test_families_vision.py", "-k", "every_point and (clip or siglip) or two_tower"],
    "dinov2": ["tests/families/test_families_vision.py", "-k", "every_point and dinov2"],
    "mamba": [
        "tests/families/test_families_ssm.py",
        "-k",
        "mamba and (every_point or hidden_states or mixer_out)",
    ],
    "rwkv": [
        "tests/families/test_families_ssm.py",
        "-k",
        "rwkv and (every_point or hidden_states or mixer_out)",
    ],
}


@dataclasses.dataclass(frozen=True)
class Mutation:
    table: str  # the arch module, e.g. "vit"
    key: str  # the entry: "blocks.*.mlp.post" or a top-level name
    rule: str  # "io", "sibling:fc1:output", "parent", "child:mlp", "layer-1"

    def __str__(self) -> str:
        return f"{self.table}: {self.key} -> {self.rule}"


def key_of(name: str) -> str:
    return re.sub(r"^blocks\.\d+\.", "blocks.*.", name)


def retarget(rule: str, spec, arch) -> tuple[str, str] | None:
    """Where the mutated entry points for this spec: (module path, io); None if nowhere."""
    flip = {"input": "output", "output": "input"}
    module, parent = spec.module, spec.module.rpartition(".")[0]
    kind, _, rest = rule.partition(":")
    if kind == "io":
        return module, flip[spec.io]
    if kind == "sibling":
        name, side = rest.split(":")
        return (f"{parent}.{name}" if parent else name), side
    if kind == "parent":
        return parent, spec.io
    if kind == "child":
        return f"{module}.{rest}", spec.io
    if kind == "layer-1" and spec.layer is not None:
        blocks = arch.block_paths
        other = blocks[spec.layer - 1] if spec.layer else blocks[1]
        return other + module[len(blocks[spec.layer]) :], spec.io
    return None


def _exists(model, path: str) -> bool:
    try:
        model.get_submodule(path)
        return True
    except AttributeError:
        return False


def rules_for(spec, arch, model) -> list[str]:
    """The plausible wrong places for one entry, as rules, where the module exists."""
    rules = ["io"]
    parent = spec.module.rpartition(".")[0]
    container = model.get_submodule(parent) if parent else model
    if not isinstance(container, torch.nn.ModuleList):  # siblings of a block are the other layers
        own = spec.module.rpartition(".")[2]
        rules += [
            f"sibling:{n}:{side}"
            for n, _ in container.named_children()
            if n != own
            for side in ("input", "output")
        ]
        if parent:
            rules.append("parent")
    rules += [f"child:{n}" for n, _ in model.get_submodule(spec.module).named_children()]
    if spec.layer is not None and arch.n_layers > 1:
        rules.append("layer-1")
    return rules


def mutations(table: str, cases: list[str]) -> dict[Mutation, list[str]]:
    """Every mutation of a table, with the cases (tiny models) where its target exists."""
    found: dict[Mutation, list[str]] = {}
    for case in cases:
        model = family_models.build(case)
        arch = arch_of(model)
        seen = set()
        for name, spec in arch.specs.items():
            key = key_of(name)
            if key in seen or re.search(r"experts\.[1-9]\d*\.", key):  # one expert's entries stand for all
                continue
            seen.add(key)
            for rule in rules_for(spec, arch, model):
                target = retarget(rule, spec, arch)
                if target and target != (spec.module, spec.io) and _exists(model, target[0]):
                    found.setdefault(Mutation(table, key, rule), []).append(case)
    return found


@contextlib.contextmanager
def applied(mutation: Mutation):
    """The table module's `table()` returns an Arch with the one entry moved."""
    module = sys.modules[f"hookscope.arch.{mutation.table}"]
    original = module.table

    def mutated(config, prefix, lm_head):
        arch = original(config, prefix, lm_head)
        arch.specs = {
            name: _moved(spec, arch, mutation) if key_of(name) == mutation.key else spec
            for name, spec in arch.specs.items()
        }
        return arch

    module.table = mutated
    try:
        yield
    finally:
        module.table = original


def _moved(spec, arch, mutation):
    target = retarget(mutation.rule, spec, arch)
    if target is None:
        return spec
    return dataclasses.replace(spec, module=target[0], io=target[1])


def caught(mutation: Mutation, cases: list[str]) -> str | None:
    """Which test caught the mutation: "relation" (a relation test's assertion), "error" (the
    wrong entry made hookscope or the model raise), "family" (the family's own tests, run under
    pytest when every relation test passed and the mutation is not an equivalent one); else
    "equivalent" (the same tensor at another module) or None (a survivor).

    The relation tests are called directly: pytest's start-up per mutation would dominate."""
    with applied(mutation):
        for case in cases:
            try:
                test_relations.test_relations(case)
            except AssertionError:
                return "relation"
            except Exception:
                return "error"
    if equivalent(mutation, cases):
        return "equivalent"
    args = ["-x", "-q", "-p", "no:cacheprovider", "--no-header", "-W", "ignore"]
    out = io.StringIO()
    with applied(mutation), contextlib.redirect_stdout(out):
        rc = pytest.main([*args, *FAMILY_TESTS[mutation.table]])
    if rc not in (0, 1, 5):  # interrupted, internal or usage error: the run, not the table, is wrong
        raise RuntimeError(f"pytest exit {rc} on {mutation}:\n{out.getvalue()[-3000:]}")
    return "family" if rc == 1 else None


def equivalent(mutation: Mutation, cases: list[str]) -> bool:
    """The wrong place holds the same tensors as the right one on every model it applies to."""
    for case in cases:
        names = [n for n in arch_of(family_models.build(case)).names if key_of(n) == mutation.key]
        right = hs.collect(family_models.build(case), family_models.inputs(case), names)
        with applied(mutation):
            try:
                wrong = hs.collect(family_models.build(case), family_models.inputs(case), names)
            except Exception:
                return False
        if any(right[n].shape != wrong[n].shape or not torch.equal(right[n], wrong[n]) for n in names):
            return False
    return True


def run(table: str, cases: list[str]) -> tuple[collections.Counter, int, list[str], list[str]]:
    """Counts of caught mutations by what caught them, the number tried, survivors, equivalents."""
    found = mutations(table, cases)
    by: collections.Counter = collections.Counter()
    survivors, same = [], []
    for mutation, where in found.items():
        how = caught(mutation, where)
        if how in (None, "equivalent"):
            (same if how else survivors).append(str(mutation))
            continue
        by[how] += 1
        if str(mutation) in ISSUE_30:
            print(f"    caught {mutation} (issue 30, by: {how})", flush=True)
    return by, len(found) - len(same), survivors, same


# the two wrong entries issue 30 found passing the suite before the relation tests
ISSUE_30 = (
    "vit: blocks.*.mlp.post -> sibling:fc1:output",
    "clip: blocks.*.resid_mid -> sibling:layer_norm1:input",
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tables", nargs="*", help="arch modules to mutate (default: all)")
    args = parser.parse_args()
    by_table: dict[str, list[str]] = {}
    for case in family_models.CASES:
        model_type = family_models.build(case).config.model_type
        by_table.setdefault(_BY_MODEL_TYPE[model_type].__name__.rsplit(".", 1)[1], []).append(case)
    tables = args.tables or list(by_table)
    overall: collections.Counter = collections.Counter()
    total = 0
    for table in tables:
        start = time.perf_counter()
        by, n, survivors, same = run(table, by_table[table])
        overall, total = overall + by, total + n
        report(
            f"{table:10s}",
            by,
            n,
            survivors,
            same,
            f"{time.perf_counter() - start:.0f} s; models: {', '.join(by_table[table])}",
            HOW,
        )
    return summary(overall, total, HOW)


HOW = ("relation", "error", "family")  # what caught a mutant, in the order reported


def _how(by: collections.Counter, kinds: tuple[str, ...]) -> str:
    return ", ".join(f"{by[k]} by {k}" for k in kinds if by[k])


def report(
    name: str, by: collections.Counter, n: int, survivors: list, same: list, when: str, kinds: tuple[str, ...]
) -> None:
    """One table's (or family's) line: mutants caught and how, then each survivor and equivalent."""
    print(
        f"{name} caught {sum(by.values())} / {n}  ({_how(by, kinds)}; {len(same)} equivalent, {when})",
        flush=True,
    )
    for line in survivors:
        print(f"    SURVIVED {line}", flush=True)
    for line in same:
        print(f"    equivalent {line}", flush=True)


def summary(overall: collections.Counter, total: int, kinds: tuple[str, ...]) -> int:
    """The last line, and the exit status: 0 when every mutant was caught."""
    print(f"caught {sum(overall.values())} / {total} mutations ({_how(overall, kinds)})")
    return 0 if sum(overall.values()) == total else 1


if __name__ == "__main__":
    sys.exit(main())
