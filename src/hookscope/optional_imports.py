"""An optional package, imported where a feature needs it, or an error that names the extra to install
(`pip install 'hookscope[EXTRA]'`), never a ModuleNotFoundError from deep inside."""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import HookscopeError


def require(
    module: str,
    *,
    extra: str,
    needed_for: str,
    error: type[HookscopeError] = HookscopeError,
    also: tuple[str, ...] = (),
) -> ModuleType:
    """`module` imported (and each of `also`, which it depends on), or `error` saying what needs it."""
    try:
        for name in also:
            importlib.import_module(name)
        return importlib.import_module(module)
    except ImportError as e:
        raise error(f"{needed_for} needs the `{module}` package: pip install 'hookscope[{extra}]'") from e
