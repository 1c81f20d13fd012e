"""What a run reports: per-step metrics in JSONL, a progress bar, and a plot at the end.

Owns: the run's `metrics.jsonl` (`RunPaths.metrics`: one JSON object per step or
evaluation), the rich progress bar with the key numbers, `reward.png`
(`RunPaths.reward_plot`: train reward and held-out success over steps, the engine-vs-trainer
mismatch, and for a multi-turn run the per-turn diagnostics), the `state_dict` a
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
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column

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
        eval_temperature: float = 0.0,
    ):
        """`trackers` (started by `looprl.trackers.start_trackers`) get every record from
        here on and `samples_per_step` rollouts per `log_samples`; they finish on exit.
        `run_dir`: the run directory (its root, or its RunPaths). `eval_temperature`
        (eval.temperature) names how held-out success was decoded: greedy at 0."""
        self.paths = RunPaths.of(run_dir)
        self.path = self.paths.metrics
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not resume:  # a resumed run keeps the file until load_state_dict replaces it
            self.path.write_text("")
        self.total_steps = total_steps
        self.records: list[dict[str, Any]] = []
        self.trackers = list(trackers or [])
        self.samples_per_step = samples_per_step
        self.eval_decoding = (
            "greedy" if eval_temperature == 0 else f"sampled at {eval_temperature:g}"
        )
        self.policy_version = 0  # of the last train record; evaluations are logged with it
        self.console = console or Console(stderr=True, log_path=False)
        self._progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(bar_width=24),
            # The summary wraps onto the next line where the terminal or a pipe (80
            # columns) is too narrow for it: rich's default cuts it with "…".
            TextColumn("{task.fields[summary]}", table_column=Column(overflow="fold")),
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
        if kind == "warning":  # already logged by whoever warned; kept for the viewer
            return record
        if self.trackers:
            step_values = self._tracker_values(record)
            self._to_trackers(lambda t: t.log(step, step_values))
        if kind == "train":
            self._progress.update(self._task, completed=step, summary=_summary(record))
        elif "nll" in record:  # looprl sft: held-out chats scored by their loss
            self.console.log(f"eval at step {step}: held-out loss per token {_num(record['nll'])}")
        else:
            self.console.log(
                f"eval at step {step}: held-out success ({self.eval_decoding}) "
                f"{_pct(record.get('accuracy'))}, mean reward {_num(record.get('reward_mean'))}"
            )
        return record

    def log_warnings(self, warnings: list[dict[str, Any]]) -> None:
        """Keep each warning ({"step", "name", "message"}, e.g. diagnostics/learning.py's)
        as a record of kind "warning", for the viewer's banner."""
        for warning in warnings:
            self.log("warning", warning["step"], {k: v for k, v in warning.items() if k != "step"})

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
        fig = figure(self.records, self.eval_decoding)
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
TURN_KEY = re.compile(r"turn(\d+)_")  # turn{k}_<name>: k is a model call's position in its episode
ACTION_PREFIX = "action_share_"  # action_share_<word>: share of replies whose first word is <word>
MAX_ACTION_WORDS = 8  # the plot folds rarer first words into "other"


def figure(records: list[dict[str, Any]], eval_decoding: str = "greedy"):
    """The plot of `records`: reward and held-out accuracy (top), mismatch (below) and,
    for a multi-turn run (train records with `turn{k}_*` keys), six panels more: return
    and advantage |mean| per turn, token entropy per turn, the two collapse signals
    (groups with equal returns, the most common first word), the first words of the
    replies and each turn's share of the loss. A single-turn run gets the first two only.
    `eval_decoding` names how held-out success was decoded, in its label."""
    import matplotlib.pyplot as plt

    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    turns = turn_positions(train)
    if not turns:
        fig, (ax, below) = plt.subplots(
            2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]}
        )
    else:
        fig = plt.figure(figsize=(13, 15))
        grid = fig.add_gridspec(5, 2, height_ratios=[2, 1, 1.3, 1.3, 1.3])
        ax = fig.add_subplot(grid[0, :])
        below = fig.add_subplot(grid[1, :], sharex=ax)
        returns, advantages, entropy, collapse, loss, actions = (
            fig.add_subplot(grid[2 + i // 2, i % 2], sharex=ax) for i in range(6)
        )
    _plot_reward(ax, train, evals, eval_decoding)
    _plot_mismatch(below, train)
    if turns:
        _plot_per_turn(returns, train, turns, "return_mean", "mean reward of the calls")
        _plot_per_turn(advantages, train, turns, "advantage_abs_mean", "mean |advantage|")
        _plot_entropy(entropy, train, turns)
        _plot_collapse(collapse, train)
        _plot_loss_shares(loss, train, turns)
        _plot_action_shares(actions, train)
    fig.tight_layout()
    return fig


def turn_positions(train: list[dict[str, Any]]) -> list[int]:
    """The turn positions k that any of the `train` records has `turn{k}_*` keys for, in
    order; none for a single-turn run."""
    return sorted({int(m.group(1)) for r in train for key in r if (m := TURN_KEY.match(key))})


def action_shares(train: list[dict[str, Any]]) -> tuple[list[int], dict[str, list[float]]]:
    """The steps that logged action shares, and each first word's share at those steps (a
    word a step did not log: 0), the words by their summed share, largest first (ties by
    name); beyond MAX_ACTION_WORDS they are added to "other", which comes last."""
    keys = {k for r in train for k in r if k.startswith(ACTION_PREFIX)}
    words = sorted(k.removeprefix(ACTION_PREFIX) for k in keys - {ACTION_PREFIX + "other"})
    steps, columns = _stacked(train, [ACTION_PREFIX + w for w in [*words, "other"]])
    shares = dict(zip([*words, "other"], columns, strict=True))
    other = shares.pop("other")
    ranked = sorted(shares, key=lambda w: -sum(shares[w]))  # stable: ties stay by name
    for word in ranked[MAX_ACTION_WORDS:]:
        other = [a + b for a, b in zip(other, shares[word], strict=True)]
    return steps, {w: shares[w] for w in ranked[:MAX_ACTION_WORDS]} | {"other": other}


def _plot_reward(
    ax, train: list[dict[str, Any]], evals: list[dict[str, Any]], eval_decoding: str
) -> None:
    ax.plot(
        [r["step"] for r in train],
        [r.get("reward_mean") for r in train],
        label="train reward (mean, sampled)",
        color="tab:blue",
    )
    ax.plot(
        [r["step"] for r in evals],
        [r.get("accuracy") for r in evals],
        "o-",
        label=f"held-out success ({eval_decoding})",
        color="tab:orange",
    )
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")


def _plot_mismatch(ax, train: list[dict[str, Any]]) -> None:
    for key, label in MISMATCH_LINES.items():
        ax.plot(*_logged(train, key), label=label)
    ax.set_title("engine vs trainer, tokens of the trainer's version", fontsize=9)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)


def _plot_per_turn(
    ax, train: list[dict[str, Any]], turns: list[int], name: str, label: str
) -> None:
    """A line per turn position of `turn{k}_<name>`, at the steps that logged it."""
    for k in turns:
        ax.plot(*_logged(train, f"turn{k}_{name}"), label=f"turn {k}", color=_turn_color(k))
    _finish(ax, f"{label} per turn position", label)


def _plot_entropy(ax, train: list[dict[str, Any]], turns: list[int]) -> None:
    ax.plot(*_logged(train, "entropy"), label="all turns", color="black", linewidth=2)
    for k in turns:
        ax.plot(*_logged(train, f"turn{k}_entropy"), label=f"turn {k}", color=_turn_color(k))
    _finish(ax, "token entropy of the sampled tokens", "entropy (nats)")


def _plot_collapse(ax, train: list[dict[str, Any]]) -> None:
    ax.plot(
        *_logged(train, "degenerate_group_share"),
        label="groups with equal returns",
        color="black",
    )
    ax.plot(
        *_logged(train, "action_top_share"),
        label="most common first word",
        color="dimgray",
        linestyle="--",
    )
    ax.set_ylim(-0.02, 1.02)
    _finish(ax, "signs of collapse", "share")


def _plot_loss_shares(ax, train: list[dict[str, Any]], turns: list[int]) -> None:
    steps, columns = _stacked(train, [f"turn{k}_loss_share" for k in turns])
    if steps:
        colors = [_turn_color(k) for k in turns]
        ax.stackplot(steps, columns, labels=[f"turn {k}" for k in turns], colors=colors)
    ax.set_ylim(0, 1)
    _finish(ax, "share of the loss from each turn position (stacked)", "share of the loss")


def _plot_action_shares(ax, train: list[dict[str, Any]]) -> None:
    import matplotlib.pyplot as plt

    steps, shares = action_shares(train)
    if steps:
        palette = plt.get_cmap("tab20").colors
        colors = [palette[i % len(palette)] for i in range(len(shares) - 1)] + ["lightgray"]
        ax.stackplot(steps, list(shares.values()), labels=list(shares), colors=colors)
    ax.set_ylim(0, 1)
    _finish(ax, "first word of the replies (stacked shares)", "share of replies")


def _finish(ax, title: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7)


def _turn_color(k: int) -> str:
    """Turn position k's color in every panel: matplotlib's k-th default color."""
    return f"C{(k - 1) % 10}"


def _logged(train: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """The steps that logged `key` (not null) and its values there."""
    rows = [r for r in train if r.get(key) is not None]
    return [r["step"] for r in rows], [r[key] for r in rows]


def _stacked(train: list[dict[str, Any]], keys: list[str]) -> tuple[list[int], list[list[float]]]:
    """The steps that logged any of `keys`, and per key its values there (not logged: 0)."""
    rows = [r for r in train if any(r.get(k) is not None for k in keys)]
    return [r["step"] for r in rows], [[r.get(k) or 0.0 for r in rows] for k in keys]


def _pct(value: Any) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _num(value: Any) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _summary(r: dict) -> str:
    return (
        f"train reward {_num(r.get('reward_mean'))}  "
        f"train success (sampled) {_pct(r.get('accuracy'))}  "
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
