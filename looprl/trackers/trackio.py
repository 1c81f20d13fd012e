"""Trackio: a local run in project `metrics.project`, in Trackio's own SQLite database
(`TRACKIO_DIR`, by default ~/.cache/huggingface/trackio; `trackio show` opens it).

Scalars by step, the config as the run's config, samples as a `trackio.Table`.
"""

from __future__ import annotations

from typing import Any

import trackio


class TrackioTracker:
    name = "trackio"

    def __init__(self, project: str, run_name: str):
        self.run = trackio.init(project=project, name=run_name)

    def log_config(self, config: dict[str, Any]) -> None:
        # Read when the first record is written: set before the first log.
        self.run.config.update(config)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        columns = list(rows[0])
        table = trackio.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])
        self.run.log({"samples": table}, step=step)

    def finish(self) -> None:
        trackio.finish()  # the current run, ours; run.finish() alone leaves it current
