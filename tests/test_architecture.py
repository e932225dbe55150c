"""The rooms import one way (docs/architecture.md): read every module's imports, lazy ones inside
functions included, and fail on an import against the flow or a circle."""

from __future__ import annotations

import ast
import builtins
import inspect
from pathlib import Path

import pytest

import hookscope as hs

SRC = Path(hs.__file__).resolve().parent


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


def imports_of(path: Path) -> set[str]:
    """Every hookscope module `path` imports, anywhere in the file (TYPE_CHECKING blocks aside)."""
    tree = ast.parse(path.read_text())
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rsplit(".", 1)[0]
    skip: set[int] = set()
    for node in ast.walk(tree):  # imports only for type checkers never run
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for n in ast.walk(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("hookscope"):
                continue
            for alias in node.names:  # `from . import compiling` imports the module hookscope.compiling
                sub = f"{target}.{alias.name}"
                found.add(sub if (SRC.parent / (sub.replace(".", "/") + ".py")).exists()
                          or (SRC.parent / sub.replace(".", "/")).is_dir() else target)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("hookscope")}
    return found - {module_name(path)}


GRAPH = {module_name(p): imports_of(p) for p in SRC.rglob("*.py")}

# room -> rooms of ours it may import (docs/architecture.md)
ALLOWED = {
    "errors": set(),
    "names": {"errors"},
    "selection": {"errors"},
    "inputs": set(),
    "arch": {"names", "errors"},
    "hooks": {"arch", "inputs", "errors"},
    "files": set(),
    "capture": {"hooks", "arch", "selection", "inputs", "names", "errors", "files"},
    "edit": {"hooks", "arch", "selection", "inputs", "names", "errors"},
    "compiling": {"hooks", "capture", "arch", "errors"},
}


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_core_rooms_import_one_way(room):
    modules = [m for m in GRAPH if room_of(m) == room]
    assert modules, room
    for module in modules:
        bad = {room_of(t) for t in GRAPH[module]} - ALLOWED[room] - {room}
        assert not bad, f"{module} imports {sorted(bad)}, against the flow in docs/architecture.md"


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
    for cls in ("Capture", "Edits", "Store", "ActivationDataset", "Loaded", "Selection", "PointDict"):
        assert cls in hs.__all__, cls


def test_no_module_and_no_public_keyword_shadows_a_builtin():
    shadowed = set(dir(builtins))
    assert not [p for p in SRC.rglob("*.py") if p.stem in shadowed]
    assert not hasattr(hs, "compile")  # the policy is hs.compile_model; the module hs.compiling
    assert hs.compile_model is hs.compiling.compile_model
    for name in hs.__all__:
        obj = getattr(hs, name)
        try:
            parameters = inspect.signature(obj).parameters if callable(obj) else {}
        except (TypeError, ValueError):  # exception classes have no signature to read
            continue
        bad = [p for p in parameters if p in shadowed]
        assert not bad, f"hs.{name} takes {bad}, named like Python builtins"
