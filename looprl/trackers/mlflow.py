"""MLflow: a run in the experiment `metrics.project`.

Stored at `MLFLOW_TRACKING_URI` when set (a tracking server, a database); otherwise in
the run's mlflow.db (`RunPaths.mlflow_db`: SQLite, MLflow's local store now that the
file store is in maintenance mode) with artifacts under its mlruns/ (`RunPaths.mlflow`).
Scalars by step, the config as params, samples as JSON artifacts
`samples/step_NNNNNN.json` (MLflow's `log_table` needs pandas).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from looprl.runs.paths import RunPaths

# log_batch's limits per request (MLflow rejects more).
_MAX_PARAMS = 100
_MAX_METRICS = 1000
_MAX_PARAM_CHARS = 6000


class MlflowTracker:
    name = "mlflow"

    def __init__(
        self,
        experiment: str,
        run_name: str,
        run_dir: Path | RunPaths,
        *,
        tracking_uri: str | None = None,
    ):
        paths = RunPaths(RunPaths.of(run_dir).root.resolve())
        local = tracking_uri is None
        if local:
            tracking_uri = f"sqlite:///{paths.mlflow_db}"
        self.client = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            artifacts = paths.mlflow.as_uri() if local else None
            experiment_id = self.client.create_experiment(experiment, artifact_location=artifacts)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id

    def log_config(self, config: dict[str, Any]) -> None:
        params = [Param(k, str(v)[:_MAX_PARAM_CHARS]) for k, v in config.items()]
        for i in range(0, len(params), _MAX_PARAMS):
            self.client.log_batch(self.run_id, params=params[i : i + _MAX_PARAMS])

    def log(self, step: int, values: dict[str, float]) -> None:
        now_ms = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now_ms, step) for k, v in values.items()]
        for i in range(0, len(metrics), _MAX_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + _MAX_METRICS])

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.client.log_dict(self.run_id, rows, f"samples/step_{step:06d}.json")

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)
