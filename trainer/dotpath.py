"""`package.module.Name` dotpaths: how adapters, engines and scorers are chosen by flag."""

from __future__ import annotations

import importlib
from typing import Any


def import_dotpath(dotpath: str, flag: str) -> Any:
    """`package.module.Name` -> the object. Errors name the flag and what to check."""
    module_name, _, attr = (dotpath or "").rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{flag}={dotpath!r} is not a dotpath of the form package.module.ClassName")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{flag}={dotpath!r}: cannot import module {module_name!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{flag}={dotpath!r}: module {module_name!r} has no attribute {attr!r}") from None
