"""The run directory's layout: every file and folder a run writes, named in one place.

`<run.fileroot>/<run.experiment_name>/<run.trial_name>/`:

    config.yaml        the resolved config (`looprl train --dry-run` prints the same)
    train.log          the run's log
    driver.pid         the driver's pid (`looprl debug stacks RUN_DIR` finds it there)
    placement.json     under Ray: where each engine replica and trainer rank runs (node, pid)
    metrics.jsonl      one record per line: train steps, evaluations, samples
    reward.png         the reward plot
    checkpoints/       recover checkpoints (step_NNNNNN/, `latest`): the newest
                       checkpoint.keep_last while running; removed when the run finishes
                       unless checkpoint.keep_on_finish
    checkpoints.replaced-<time>/  an earlier run's, set aside by a new run in this folder
    trajectories/      the rollouts each step trained on, as Parquet (step_NNNNNN.parquet)
    frames/            env.frames_every: rendered episodes, <session_id>.gif
    model/             the trained policy (a Hugging Face folder, or a LoRA adapter)
    best/              the policy at its best held-out evaluation (eval.save_best), in
                       model/'s format, with looprl-best.json: its step and accuracy
    summary.json       the finished run's result (TrainSummary), written at its end
    processes/         one JSON per live looprl process (the hang watchdog's registry)
    hangs/             hang reports with every process's stacks
    logs/              a vLLM / SGLang server's log
    weights/           weight folders a vLLM / SGLang server reloads from
    engines/replica-N/ under Ray: a replica's own logs/ and weights/
    tensorboard/       the TensorBoard tracker's event files
    mlflow.db          the MLflow tracker's local store (SQLite), without MLFLOW_TRACKING_URI
    mlruns/            its artifacts (the samples tables)
    wandb/             the W&B tracker's runs (wandb.init(dir=root) makes the folder)

Start-up makes one `RunPaths` for a run (looprl.startup) and hands it down; a
component takes the path it writes, never spells it. Components that are still given
the run directory's root build the names from it with `RunPaths.of(run_dir)`, which
takes a `RunPaths` as well. The viewer and `looprl show` read runs through the same
names. What is inside a folder is its writer's format: checkpoint.py's step folders,
trajectories.py's step files, `frame_file`'s GIFs, the watchdog's registry entries and
reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunPaths:
    """The paths of the run directory `root`."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @classmethod
    def of(cls, run: str | Path | RunPaths) -> RunPaths:
        """`run` itself when it is a RunPaths, else the paths of the run directory `run`."""
        return run if isinstance(run, RunPaths) else cls(Path(run))

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def log(self) -> Path:
        return self.root / "train.log"

    @property
    def driver_pid(self) -> Path:
        return self.root / "driver.pid"

    @property
    def placement(self) -> Path:
        return self.root / "placement.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def reward_plot(self) -> Path:
        return self.root / "reward.png"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def trajectories(self) -> Path:
        return self.root / "trajectories"

    @property
    def frames(self) -> Path:
        return self.root / "frames"

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def best(self) -> Path:
        return self.root / "best"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def processes(self) -> Path:
        return self.root / "processes"

    @property
    def hangs(self) -> Path:
        return self.root / "hangs"

    @property
    def server_logs(self) -> Path:
        return self.root / "logs"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def mlflow(self) -> Path:
        """The MLflow tracker's artifacts."""
        return self.root / "mlruns"

    @property
    def mlflow_db(self) -> Path:
        """The MLflow tracker's local store, when no MLFLOW_TRACKING_URI names one."""
        return self.root / "mlflow.db"

    def replica(self, index: int) -> RunPaths:
        """Under Ray, engine replica `index`'s own folder (its server logs and weights)."""
        return RunPaths(self.root / "engines" / f"replica-{index}")


def frame_file(frames: Path, session_id: str) -> Path:
    """The GIF of the episode played in gateway session `session_id`, in `frames`."""
    return Path(frames) / f"{session_id}.gif"
