"""What reaches a user is importable from `hookscope`: every error class the package raises, read
from the source (not from `hookscope.__all__`), and the types the routing edits return."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import hookscope as hs

SRC = Path(hs.__file__).resolve().parent


def raised_error_classes() -> set[str]:
    """The names of the HookscopeError subclasses defined anywhere in the package (a class whose
    base is HookscopeError or one of them), found by reading every module's class statements."""
    bases: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                bases.setdefault(node.name, set()).update(names)
    errors = {"HookscopeError"}
    while grown := {c for c, b in bases.items() if b & errors} - errors:
        errors |= grown
    return errors


def raised_names() -> set[str]:
    """Every name that follows `raise` in the package (`raise X(...)` or `raise X`)."""
    found = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name):
                    found.add(exc.id)
    return found


def test_every_error_class_is_exported():
    errors = raised_error_classes()
    assert {"PointNotLoadedError", "SAEError", "StaleIndexError"} <= errors  # the reading finds them
    missing = sorted(errors - set(hs.__all__))
    assert not missing, f"HookscopeError subclasses not in hookscope.__all__: {missing}"
    for name in errors:
        assert issubclass(getattr(hs, name), hs.HookscopeError), name
    # and each is raised somewhere (an exported error nobody raises would be dead weight)
    assert errors - {"HookscopeError"} <= raised_names()


def test_routing_edits_return_exported_types():
    """`ablate_expert` / `force_route` hand back `hs.AblateExperts` / `hs.ForceRoute`, annotated so,
    and the returned edit does what it says on a router's dense routing tensor."""
    ablate, force = hs.ablate_expert(0, [1, 3]), hs.force_route(1, [0, 2], tokens=[1])
    assert type(ablate) is hs.AblateExperts and type(force) is hs.ForceRoute
    assert isinstance(ablate, hs.Edit) and isinstance(force, hs.Edit)
    for verb, cls in ((hs.ablate_expert, hs.AblateExperts), (hs.force_route, hs.ForceRoute)):
        assert eval(verb.__annotations__["return"], verb.__globals__) is cls
    routing = torch.arange(1.0, 13.0).reshape(3, 4)  # 3 tokens, 4 experts
    assert ablate(routing, None)[:, [1, 3]].eq(0).all()
    assert torch.equal(ablate(routing, None)[:, [0, 2]], routing[:, [0, 2]])
    forced = force(routing, None)
    assert forced[1].tolist() == [0.5, 0.0, 0.5, 0.0]
    assert torch.equal(forced[[0, 2]], routing[[0, 2]])
