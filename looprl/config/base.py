"""What every section shares: unknown keys rejected, assignments validated; ConfigError."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field and what to change."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
