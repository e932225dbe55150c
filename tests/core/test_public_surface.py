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


def test_every_edit_verb_returns_the_one_exported_edit_type():
    """`ablate`, `patch`, `steer`, `ablate_expert`, `force_route` hand back an `hs.Edit` (each kind's
    class stays in its module: one concept, `Edit`, exported once), annotated so, and the routing
    edits do what they say on a router's dense routing tensor."""
    ablate, force = hs.ablate_expert(0, [1, 3]), hs.force_route(1, [0, 2], tokens=[1])
    edits = [ablate, force, hs.ablate("blocks.0.mlp.out"), hs.steer("blocks.0.resid_post", torch.ones(4))]
    assert all(isinstance(e, hs.Edit) for e in edits)
    for verb in (hs.ablate_expert, hs.force_route, hs.ablate, hs.patch, hs.steer):
        assert eval(verb.__annotations__["return"], verb.__globals__) is hs.Edit, verb.__name__
        assert type(verb(*_args(verb))).__name__ not in hs.__all__  # the kind's class is not exported
    routing = torch.arange(1.0, 13.0).reshape(3, 4)  # 3 tokens, 4 experts
    assert ablate(routing, None)[:, [1, 3]].eq(0).all()
    assert torch.equal(ablate(routing, None)[:, [0, 2]], routing[:, [0, 2]])
    forced = force(routing, None)
    assert forced[1].tolist() == [0.5, 0.0, 0.5, 0.0]
    assert torch.equal(forced[[0, 2]], routing[[0, 2]])


def _args(verb):
    """Arguments that build an edit (nothing runs): the first point and its source."""
    return {
        "ablate_expert": (0, 1),
        "force_route": (0, [0]),
        "ablate": ("blocks.0.mlp.out",),
        "patch": ("blocks.0.mlp.out", torch.zeros(1, 2, 4)),
        "steer": ("blocks.0.resid_post", torch.ones(4)),
    }[verb.__name__]
