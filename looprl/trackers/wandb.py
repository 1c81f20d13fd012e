"""Weights & Biases: a run under the run directory's wandb/ (wandb.init(dir=the run's
root) makes it), online or offline.

The mode is `WANDB_MODE` when set; otherwise online with `WANDB_API_KEY` set and
offline without it (an offline run uploads later with `wandb sync RUN_DIR/wandb/offline-run-*`).
Scalars by step, the config as the run's config, samples as a `wandb.Table`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import wandb

from looprl.runs.paths import RunPaths

log = logging.getLogger(__name__)


class WandbTracker:
    name = "wandb"

    def __init__(self, project: str, run_name: str, run_dir: Path | RunPaths):
        mode = os.environ.get("WANDB_MODE") or (
            "online" if os.environ.get("WANDB_API_KEY") else "offline"
        )
        self.run = wandb.init(
            project=project, name=run_name, dir=str(RunPaths.of(run_dir).root), mode=mode
        )
        if mode == "offline":
            log.info(
                "W&B logs offline to %s (no WANDB_API_KEY): `wandb sync %s` uploads it; set "
                "WANDB_API_KEY or WANDB_MODE=online to log live",
                self.run.dir,
                Path(self.run.dir).parent,
            )

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        columns = list(rows[0])
        table = wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])
        self.run.log({"samples": table}, step=step)

    def finish(self) -> None:
        self.run.finish()
