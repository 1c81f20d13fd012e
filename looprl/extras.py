"""The optional parts of looprl and the packages each needs: the runtime (what the default
job imports) installs with looprl, everything else with its extra (pyproject.toml's
optional-dependencies). A setting that needs an extra whose packages are missing fails
at start-up with the line that installs it, before anything starts."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from looprl.config import ConfigError

if TYPE_CHECKING:
    from looprl.config import Config

# extra -> the modules it installs that looprl imports
PACKAGES = {
    "ray": ("ray", "psutil"),
    "lora": ("peft",),
    "tensorboard": ("tensorboard",),
    "wandb": ("wandb",),
    "mlflow": ("mlflow", "sqlalchemy", "alembic"),  # the local store is SQLite
    "trackio": ("trackio",),
}


def missing(extra: str) -> list[str]:
    """The modules of `extra` that are not installed (found without importing them)."""
    return [name for name in PACKAGES[extra] if importlib.util.find_spec(name) is None]


def install_line(extra: str) -> str:
    return f"pip install 'looprl[{extra}]'"


def required(cfg: Config) -> dict[str, str]:
    """The extras `cfg` needs beyond the runtime, each with the setting that needs it."""
    needs = {}
    if cfg.scheduler.type == "ray":
        needs["ray"] = "scheduler.type=ray"
    if cfg.model.lora.enabled:
        needs["lora"] = f"model.lora.rank={cfg.model.lora.rank}"
    return needs


def check_installed(cfg: Config) -> None:
    """ConfigError naming the setting and the install line for the first extra `cfg`
    needs whose packages are missing."""
    for extra, setting in required(cfg).items():
        if absent := missing(extra):
            raise ConfigError(
                f"{setting} needs {', '.join(absent)}, which is not installed: "
                f"{install_line(extra)}"
            )
