"""The rooms import one way: the contracts in pyproject.toml (`[tool.importlinter]`, their one copy)
hold, checked by import-linter (lazy imports inside functions and those under TYPE_CHECKING count),
and an import up the layers breaks them. No circle between modules; the picture in
docs/img/architecture.svg draws the contract's layers and the imports the code makes. How long a
function may grow is ruff's complexity rules' business (pyproject.toml, tests/core/test_style.py)."""

from __future__ import annotations

import ast
import builtins
import inspect
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import hookscope as hs

SRC = Path(hs.__file__).resolve().parent
ROOT = SRC.parents[1]


def room_of(module: str) -> str:
    """`hookscope.store.reader` -> `store`, `hookscope.capture` -> `capture`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


@dataclass(frozen=True)
class Import:
    target: str  # the hookscope module imported
    line: int
    lazy: bool  # inside a function: runs later, and still couples the two rooms


def _exists(module: str) -> bool:
    path = SRC.parent / module.replace(".", "/")
    return path.with_suffix(".py").exists() or path.is_dir()


def imports_in(source: str, module: str, *, is_package: bool, exists=_exists) -> list[Import]:
    """Every hookscope module `source` (the text of `module`) imports, anywhere in it: those only
    type checkers read (`if TYPE_CHECKING:`) too, since a type named across rooms couples them as
    much as a call does. `exists(name)`: whether a dotted name is a module (`from . import x`
    imports the module x, or a name x of the package)."""
    tree = ast.parse(source)
    package = module if is_package else module.rsplit(".", 1)[0]
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function |= {id(n) for n in ast.walk(node)}
    found: list[Import] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("hookscope"):  # `from . import images` imports hookscope.images
                targets = [
                    f"{target}.{a.name}" if exists(f"{target}.{a.name}") else target for a in node.names
                ]
        else:
            targets = [a.name for a in node.names if a.name.startswith("hookscope")]
        found += [Import(t, node.lineno, id(node) in in_function) for t in targets if t != module]
    return found


def imports_of(path: Path) -> list[Import]:
    return imports_in(path.read_text(), module_name(path), is_package=path.name == "__init__.py")


GRAPH = {module_name(p): {i.target for i in imports_of(p)} for p in SRC.rglob("*.py")}


def lint_imports(src: Path) -> subprocess.CompletedProcess:
    """import-linter's `lint-imports` on the package under `src`, with this tree's contracts."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.fail(
            "import-linter is not installed: it comes with the `test` extra (pip install -e '.[test]')"
        )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [exe, "--no-cache", str(ROOT / "pyproject.toml")], cwd=ROOT, env=env, capture_output=True, text=True
    )


def test_the_import_contracts_hold():
    done = lint_imports(SRC.parent)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_an_import_up_the_layers_breaks_the_contract(tmp_path):
    """The contract is no formality: the capture core reaching lazily into the extraction (a
    layer above it) is refused, named by module and line."""
    shutil.copytree(SRC, tmp_path / "hookscope", ignore=shutil.ignore_patterns("__pycache__"))
    capture = tmp_path / "hookscope" / "capture.py"
    capture.write_text(capture.read_text() + "\n\ndef _upward():\n    from .extract import loop\n")
    done = lint_imports(tmp_path)
    assert done.returncode != 0
    assert "hookscope.capture is not allowed to import hookscope.extract" in done.stdout, done.stdout[-3000:]


def test_the_checker_sees_lazy_relative_and_package_imports():
    """What the checks above rely on, on a module written here: a store module that reaches up."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from .manifest import Manifest\n"
        "from .. import progress\n"
        "import hookscope.capture\n"
        "if TYPE_CHECKING:\n"
        "    from ..models import Loaded\n"
        "def top(self):\n"
        "    from ..top import top\n"
    )
    modules = {"hookscope.progress", "hookscope.top.query"}  # `top` (the function) is not one
    found = imports_in(source, "hookscope.store.reader", is_package=False, exists=modules.__contains__)
    assert {(i.target, i.lazy) for i in found} == {
        ("hookscope.store.manifest", False),
        ("hookscope.progress", False),
        ("hookscope.capture", False),
        ("hookscope.models", False),
        ("hookscope.top", True),
    }


def test_hooks_and_capture_never_import_the_compile_layer():
    for module in ("hookscope.hooks", "hookscope.capture", "hookscope.edit", "hookscope.selection"):
        assert not any(room_of(t) == "compiling" for t in GRAPH[module]), module


def cycles() -> list[list[str]]:
    """Every circle of imports between modules (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in GRAPH:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert cycles() == [], "import circles (lazy imports inside functions count too)"


def test_the_public_surface_is_listed_once():
    assert len(hs.__all__) == len(set(hs.__all__))
    for name in hs.__all__:
        assert hasattr(hs, name), name
    from importlib.metadata import version

    assert hs.__version__ == version("hookscope")
    # what the public functions hand back is public too
    for cls in (
        "Capture",
        "Edits",
        "Store",
        "ActivationDataset",
        "Loaded",
        "Arch",
        "PointDict",
        "Generation",
        "ProfileReport",
        "PointInfo",
        "ExtractConfig",
        "ExtractSummary",
        "TopResult",
        "Manifest",
        "Column",
        "PointStats",
        "SaelensExport",
    ):
        assert cls in hs.__all__, cls
    for verb in (
        "load",
        "points",
        "hooks",
        "collect",
        "capture",
        "grads",
        "generate",
        "edit",
        "extract",
        "open_store",
        "top",
        "export_saelens",
        "export_hf",
        "profile",
        "compile_model",
    ):
        assert callable(getattr(hs, verb)) and verb in hs.__all__, verb


def test_the_public_verbs_say_what_they_return():
    """Each verb's return annotation is the public type it hands back (evaluated in the verb's own
    module: the annotations are strings under `from __future__ import annotations`)."""
    want = {
        # a vLLM engine's collect: one PointDict per prompt (verbs.py)
        "collect": hs.PointDict | list[hs.PointDict],
        "grads": hs.PointDict,
        "capture": hs.Capture,
        "load": hs.Loaded,
        "extract": hs.ExtractSummary,
        # a vLLM engine's generate: one Generation per prompt (verbs.py)
        "generate": hs.Generation | list[hs.Generation],
        "open_store": hs.Store,
        "top": hs.TopResult,
        "export_saelens": hs.SaelensExport,
    }
    for verb, cls in want.items():
        fn = getattr(hs, verb)
        returned = fn.__annotations__["return"]
        assert eval(returned, fn.__globals__) == cls, f"hs.{verb} is annotated to return {returned}"


def test_the_extension_api_is_in_its_submodules_not_at_the_top():
    import importlib

    # the modules (hs.hooks is the function of the same name)
    arch, compiling, hooks = (
        importlib.import_module(f"hookscope.{m}") for m in ("arch", "compiling", "hooks")
    )
    for name, home in (
        ("PointSpec", arch),
        ("arch_of", arch),
        ("Hook", hooks),
        ("add_hook", hooks),
        ("compile_stats", compiling),
    ):
        assert name not in hs.__all__ and hasattr(home, name), name
    assert "compiling" not in hs.__all__ and not hasattr(compiling, "clones_outputs")


def test_no_module_and_no_public_keyword_shadows_a_builtin():
    shadowed = set(dir(builtins))
    assert not [p for p in SRC.rglob("*.py") if p.stem in shadowed]
    assert not hasattr(hs, "compile")  # the policy is hs.compile_model; the module hookscope.compiling
    from hookscope import compiling

    assert hs.compile_model is compiling.compile_model
    for name in hs.__all__:
        obj = getattr(hs, name)
        try:
            parameters = inspect.signature(obj).parameters if callable(obj) else {}
        except (TypeError, ValueError):  # exception classes have no signature to read
            continue
        bad = [p for p in parameters if p in shadowed]
        assert not bad, f"hs.{name} takes {bad}, named like Python builtins"


def test_no_code_reads_a_room_through_the_verb_that_shadows_it():
    """`hs.extract`, `hs.top`, `hs.hooks`... are the functions, which hide the modules of the same
    name as attributes of the package: `hookscope.extract.loop.X = ...` sets nothing on the module
    (or raises). Such code must import the module (`from hookscope.extract import loop`)."""
    shadowed = {name for name in hs.__all__ if (SRC / name).is_dir() or (SRC / f"{name}.py").exists()}
    assert {"extract", "top", "hooks"} <= shadowed
    root = SRC.parents[1]
    bad = []
    for folder in ("src", "tests", "bench", "scripts", "examples"):
        for path in (root / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                inner = node.value if isinstance(node, ast.Attribute) else None
                if (
                    isinstance(inner, ast.Attribute)
                    and isinstance(inner.value, ast.Name)
                    and inner.value.id in ("hookscope", "hs")
                    and inner.attr in shadowed
                ):
                    bad.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "reads a module through the function that shadows it:\n" + "\n".join(bad)


def test_the_picture_draws_the_contract_and_the_code():
    """docs/img/architecture.svg (drawn by tests/core/architecture_picture.py) has a box per room of the
    layers contract and an arrow per room-to-room import the code makes, no more: the top layer's
    (`cli/`) is one arrow to "*"."""
    import xml.etree.ElementTree as ET

    from architecture_picture import contract_layers, edges, room_imports

    svg = ET.parse(ROOT / "docs" / "img" / "architecture.svg").getroot()
    ns = "{http://www.w3.org/2000/svg}"
    drawn = {
        (e.get("data-from"), e.get("data-to")) for e in svg.iter(f"{ns}path") if e.get("class") == "edge"
    }
    rooms = {g.get("data-room") for g in svg.iter(f"{ns}g") if g.get("class") == "room"}
    layers = contract_layers()
    want = set(edges(layers, room_imports()))
    assert rooms == {r for layer in layers for r in layer}, "run `python tests/core/architecture_picture.py`"
    assert drawn == want, (
        f"arrows the code does not make: {sorted(drawn - want)}; imports not drawn: {sorted(want - drawn)}: "
        "run `python tests/core/architecture_picture.py`"
    )
