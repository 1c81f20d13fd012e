"""Loading: a YAML file and `a.b=value` overrides into a Config, and validation failures
as one readable ConfigError naming the field path and the value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from looprl.config.base import ConfigError
from looprl.config.schema import Config


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Build a Config from an optional YAML file and `a.b=value` overrides.

    Override values are parsed as YAML (`8` is an int, `[a, b]` a list, `null` None).
    Raises ConfigError naming the file, the field path and the offending value.
    """
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
        data = loaded or {}
    for item in overrides:
        _apply_override(data, item)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        source = f" (from {path})" if path else ""
        raise ConfigError(f"invalid config{source}:\n" + _describe(e, data)) from None


def _apply_override(data: dict, item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(
            f"override {item!r} must look like section.field=value, e.g. rollout.group_size=8"
        )
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        value = raw
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
        node = child
    node[leaf] = value


def _describe(error: ValidationError, data: dict) -> str:
    lines = []
    for err in error.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"  {loc}: unknown field{_suggest(err['loc'])}")
        elif err["type"] == "value_error" and isinstance(err.get("input"), dict):
            # A check across fields: its message names them; the section's dict is noise.
            lines.append(f"  {loc}: {err['ctx']['error']}" if loc else f"  {err['ctx']['error']}")
        else:
            lines.append(f"  {loc}={err.get('input')!r}: {err['msg']}")
    return "\n".join(lines)


def _suggest(loc: tuple) -> str:
    """Name the closest valid field, for typos like `rollout.grop_size`."""
    import difflib

    model: type[BaseModel] = Config
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None or not isinstance(field.annotation, type):
            return ""
        model = field.annotation
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    valid = ", ".join(model.model_fields)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{hint} (valid: {valid})"
