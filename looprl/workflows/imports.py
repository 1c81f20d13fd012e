"""`import_object`: the one way looprl turns a `module:Name` string from a config into
the object it names (workflows, reward functions, env factories, datasets)."""

from __future__ import annotations

import importlib
from typing import Any


def import_object(spec: str, what: str = "object") -> Any:
    """Import `module:Name` (or `module.Name`), naming the spec in every error."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what} {spec!r} must look like 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r}: {e}") from e
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ValueError(f"{what} {spec!r}: module {module_name!r} has no {attr!r}") from None
    return obj
