"""What a run reports: per-step metrics in JSONL, a progress bar, and a plot at the end.

Owns: the run's `metrics.jsonl` (`RunPaths.metrics`: one JSON object per step or
evaluation), the rich progress bar with the key numbers, `reward.png`
(`RunPaths.reward_plot`: reward and held-out accuracy over steps), the `state_dict` a
checkpoint needs to continue the file (a resume rewinds the file atomically, through
looprl/runs/atomic.py), and sending each record and a few rollouts per step to the
experiment trackers (looprl/trackers/). Knows nothing of how the numbers are produced.

To trackers, a record's numbers go as `train/<name>` or `eval/<name>` (nested dicts,
e.g. `errors`, as `train/errors/<key>`; non-finite and non-numbers left out) at its
step, with the trainer's `version` as `policy_version` (an evaluation gets the version
of the last train step). A tracker that raises is logged once and turned off: the run
and `metrics.jsonl` go on without it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from looprl.runs.atomic import atomic_write_text
from looprl.runs.paths import RunPaths
from looprl.trackers import Tracker, flatten

if TYPE_CHECKING:
    import torch

    from looprl.types import Trajectory

log = logging.getLogger(__name__)


def _clean(value: Any) -> Any:
    """JSON has no NaN: write None for non-finite floats; tensors become numbers."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class Metrics:
    def __init__(
        self,
        run_dir: Path | RunPaths,
        total_steps: int,
        *,
        console: Console | None = None,
        show_progress: bool = True,
        resume: bool = False,
        trackers: list[Tracker] | None = None,
        samples_per_step: int = 0,
    ):
        """`trackers` (started by `looprl.trackers.start_trackers`) get every record from
        here on and `samples_per_step` rollouts per `log_samples`; they finish on exit.
        `run_dir`: the run directory (its root, or its RunPaths)."""
        self.paths = RunPaths.of(run_dir)
        self.path = self.paths.metrics
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not resume:  # a resumed run keeps the file until load_state_dict replaces it
            self.path.write_text("")
        self.total_steps = total_steps
        self.records: list[dict[str, Any]] = []
        self.trackers = list(trackers or [])
        self.samples_per_step = samples_per_step
        self.policy_version = 0  # of the last train record; evaluations are logged with it
        self.console = console or Console(stderr=True, log_path=False)
        self._progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(bar_width=24),
            TextColumn("{task.fields[summary]}"),
            TimeElapsedColumn(),
            console=self.console,
            disable=not show_progress,
        )
        self._task = self._progress.add_task("train", total=total_steps, summary="starting")

    def __enter__(self) -> Metrics:
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()
        self._to_trackers(lambda t: t.finish())

    def status(self, text: str) -> None:
        """Say what the run is doing now, on the progress line."""
        self._progress.update(self._task, summary=text)

    def log(self, kind: str, step: int, values: dict[str, Any]) -> dict[str, Any]:
        record = {"kind": kind, "step": step, "time": time.time()}
        record.update({k: _clean(v) for k, v in values.items()})
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.trackers:
            step_values = self._tracker_values(record)
            self._to_trackers(lambda t: t.log(step, step_values))
        if kind == "train":
            self._progress.update(self._task, completed=step, summary=_summary(record))
        elif "nll" in record:  # looprl sft: held-out chats scored by their loss
            self.console.log(f"eval at step {step}: held-out loss per token {_num(record['nll'])}")
        else:
            self.console.log(
                f"eval at step {step}: accuracy {_pct(record.get('accuracy'))}, "
                f"mean reward {_num(record.get('reward_mean'))}"
            )
        return record

    def log_samples(
        self,
        step: int,
        trajectories: list[Trajectory],
        advantages: torch.Tensor,
        decode: Callable[[list[int]], str],
    ) -> None:
        """The first `samples_per_step` trajectories of a step, with their advantages
        (N,) (aligned with `trajectories`), to the trackers as a table."""
        if self.trackers and self.samples_per_step:
            n = self.samples_per_step
            rows = sample_rows(trajectories[:n], advantages[:n], decode)
            self._to_trackers(lambda t: t.log_samples(step, rows))

    def _tracker_values(self, record: dict[str, Any]) -> dict[str, float]:
        kind = record["kind"]
        values = {k: v for k, v in record.items() if k not in ("kind", "step", "time")}
        if kind == "train" and "version" in values:
            self.policy_version = values.pop("version")
        named = {
            k: float(v)
            for k, v in flatten({kind: values}, sep="/").items()
            if isinstance(v, int | float) and math.isfinite(v)
        }
        return named | {"policy_version": float(self.policy_version)}

    def _to_trackers(self, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception:
                log.exception(
                    "The %s tracker failed and is turned off for the rest of this run "
                    "(metrics.jsonl still gets every record); remove it from "
                    "metrics.backends if it fails again",
                    tracker.name,
                )
                self.trackers.remove(tracker)

    def plot(self, path: Path | None = None) -> Path:
        """Reward (train rollouts) and held-out accuracy over steps and, below, the
        engine-vs-trainer mismatch, as a PNG at `path` (default: the run's reward.png)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = path or self.paths.reward_plot
        fig = figure(self.records)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def state_dict(self) -> dict:
        return {"records": self.records}

    def load_state_dict(self, state: dict) -> None:
        """Back to the checkpoint's records; steps logged after it are dropped (they run
        again). Trackers are not sent the restored records: they have them already."""
        self.records = list(state["records"])
        # Atomically: killed here, the file still holds every step up to the checkpoint.
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
        train = [r for r in self.records if r["kind"] == "train"]
        self._progress.update(self._task, completed=max((r["step"] for r in train), default=0))
        self.policy_version = train[-1].get("version", 0) if train else 0


MISMATCH_LINES = {
    "mismatch_logprob_abs_mean": "mean |log pi_trainer - log pi_engine|",
    "mismatch_kl_k3": "KL(engine || trainer), k3",
}


def figure(records: list[dict[str, Any]]):
    """The plot of `records`: reward and held-out accuracy (top), mismatch (bottom)."""
    import matplotlib.pyplot as plt

    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    fig, (ax, below) = plt.subplots(
        2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    ax.plot(
        [r["step"] for r in train],
        [r.get("reward_mean") for r in train],
        label="train reward (mean)",
        color="tab:blue",
    )
    ax.plot(
        [r["step"] for r in evals],
        [r.get("accuracy") for r in evals],
        "o-",
        label="held-out accuracy (greedy)",
        color="tab:orange",
    )
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    for key, label in MISMATCH_LINES.items():
        below.plot(
            [r["step"] for r in train if r.get(key) is not None],
            [r[key] for r in train if r.get(key) is not None],
            label=label,
        )
    below.set_title("engine vs trainer, tokens of the trainer's version", fontsize=9)
    below.set_xlabel("step")
    below.grid(alpha=0.3)
    below.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    return fig


def _pct(value: Any) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _num(value: Any) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _summary(r: dict) -> str:
    return (
        f"reward {_num(r.get('reward_mean'))}  acc {_pct(r.get('accuracy'))}  "
        f"loss {_num(r.get('loss'))}  len {r.get('response_length', 0):.0f}  "
        f"{r.get('step_time_s', 0):.1f} s/step"
    )


def sample_rows(
    trajectories: list[Trajectory], advantages: torch.Tensor, decode: Callable[[list[int]], str]
) -> list[dict[str, Any]]:
    """A row per trajectory: the prompt (the tokens before the first sampled one), the
    completion (the rest: sampled tokens and, for a multi-turn sample, the tool results
    and turns between them), reward, advantage and group id."""
    rows = []
    for t, advantage in zip(trajectories, advantages.tolist(), strict=True):
        first = int(t.loss_mask.nonzero()[0])
        ids = t.input_ids.tolist()
        rows.append(
            {
                "prompt": decode(ids[:first]),
                "completion": decode(ids[first:]),
                "reward": float(t.reward),
                "advantage": float(advantage),
                "group_id": t.group_id,
            }
        )
    return rows
