"""Experiment trackers: where a run's metrics go besides `metrics.jsonl`.

Owns the `Tracker` protocol, starting the trackers `metrics.backends` names, and the
flattened config they log as hyperparameters. One module per backend (tensorboard.py,
wandb.py, mlflow.py, trackio.py), each imported only when chosen, each its own extra
(`pip install 'looprl[wandb]'`). Where a tracker writes in the run directory is
`RunPaths`' (looprl/runs/paths.py: tensorboard/, mlflow.db and mlruns/, wandb/). Does
not own what is logged or when: `Metrics` sends every record to each tracker and turns
off one that fails, so a tracker never stops training.

A resumed run starts new tracker runs (W&B, MLflow, Trackio) that hold the steps from
the checkpoint on; TensorBoard writes to the same folder and hides the events of the
steps that run again (`purge_step`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from looprl import extras
from looprl.config import ConfigError
from looprl.runs.paths import RunPaths

if TYPE_CHECKING:
    from looprl.config import Config


class Tracker(Protocol):
    name: str  # the metrics.backends entry, for error messages

    def log_config(self, config: dict[str, Any]) -> None:
        """The resolved config, flattened to dotted keys, as hyperparameters."""

    def log(self, step: int, values: dict[str, float]) -> None:
        """Scalars at a training step: `train/<name>`, `eval/<name>`, `policy_version`."""

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Rollouts of a step as a table: prompt, completion, reward, advantage, group_id."""

    def finish(self) -> None:
        """Flush and close."""


def check_installed(cfg: Config) -> list[str]:
    """The trackers `metrics.backends` names (jsonl is not one); ConfigError naming the
    extra to install for one whose package is missing (checked before a run starts
    anything). Each tracker's extra has its name (looprl/extras.py)."""
    names = [name for name in dict.fromkeys(cfg.metrics.backends) if name != "jsonl"]
    for name in names:
        if absent := extras.missing(name):
            raise ConfigError(
                f"metrics.backends has {name!r} but {', '.join(absent)} is not installed: "
                f"{extras.install_line(name)}, or remove {name} from metrics.backends"
            )
    return names


def start_trackers(cfg: Config, run_dir: Path | RunPaths, *, first_step: int = 1) -> list[Tracker]:
    """Start each tracker in `cfg.metrics.backends` (jsonl is always on and is not one)
    and log the resolved config to it. `run_dir`: the run directory, its root or its
    RunPaths. `first_step` > 1 is a resume from step `first_step - 1`. A tracker whose
    package is missing raises ConfigError naming the extra to install."""
    paths = RunPaths.of(run_dir)
    names = check_installed(cfg)
    run_name = f"{cfg.run.experiment_name}-{cfg.run.trial_name}"
    project = cfg.metrics.project
    trackers: list[Tracker] = []
    for name in names:
        if name == "tensorboard":
            from looprl.trackers.tensorboard import TensorBoardTracker

            purge_step = first_step if first_step > 1 else None
            trackers.append(TensorBoardTracker(paths.tensorboard, purge_step=purge_step))
        elif name == "wandb":
            from looprl.trackers.wandb import WandbTracker

            trackers.append(WandbTracker(project, run_name, paths))
        elif name == "mlflow":
            from looprl.trackers.mlflow import MlflowTracker

            uri = os.environ.get("MLFLOW_TRACKING_URI")
            trackers.append(MlflowTracker(project, run_name, paths, tracking_uri=uri))
        elif name == "trackio":
            from looprl.trackers.trackio import TrackioTracker

            trackers.append(TrackioTracker(project, run_name))
    config = flatten(cfg.model_dump(mode="json"))
    for tracker in trackers:
        tracker.log_config(config)
    return trackers


def flatten(tree: dict[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """Nested dicts to one level, keys joined by `sep`; other values (lists too) as they
    are. `{"a": {"b": 1}, "c": [2]}` -> `{"a.b": 1, "c": [2]}`."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}{sep}", sep))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
