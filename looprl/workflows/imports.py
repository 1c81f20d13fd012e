"""`import_object`: the one way looprl turns a `module:Name` string from a config into
the object it names (workflows, reward functions, env factories, datasets)."""

from __future__ import annotations

import importlib
import inspect
from typing import Any


def import_object(spec: str, what: str = "object") -> Any:
    """Import `module:Name` (or `module.Name`), naming the spec in every error: a module
    not found says where Python looked, a missing name lists what the module defines."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what} {spec!r} must look like 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        hint = ""
        if e.name is not None and f"{module_name}.".startswith(f"{e.name}."):  # not found
            hint = "; run looprl from the folder that holds it, or add that folder to PYTHONPATH"
        raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r}: {e}{hint}") from e
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        where = f" ({module.__file__})" if getattr(module, "__file__", None) else ""
        names = _defined_names(module)
        has = f" (it has: {', '.join(names)}); set {what} to one of them" if names else ""
        raise ValueError(
            f"{what} {spec!r}: module {module_name!r}{where} has no {attr!r}{has}"
        ) from None
    return obj


def _defined_names(module: Any, most: int = 10) -> list[str]:
    """The public classes and functions `module` defines itself (not those it imports)."""
    names = [
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(obj) or inspect.isfunction(obj))
        and getattr(obj, "__module__", None) == module.__name__
    ]
    return names[:most]
