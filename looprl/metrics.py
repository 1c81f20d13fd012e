"""What a run reports: per-step metrics in JSONL, a progress bar, and a plot at the end.

Owns: `metrics.jsonl` in the run dir (one JSON object per step or evaluation), the
rich progress bar with the key numbers, `reward.png` (reward and held-out accuracy
over steps) and the `state_dict` a checkpoint needs to continue the file.
Knows nothing of how the numbers are produced.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


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
        run_dir: Path,
        total_steps: int,
        *,
        console: Console | None = None,
        show_progress: bool = True,
        resume: bool = False,
    ):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not resume:  # a resumed run keeps the file until load_state_dict replaces it
            self.path.write_text("")
        self.total_steps = total_steps
        self.records: list[dict[str, Any]] = []
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

    def status(self, text: str) -> None:
        """Say what the run is doing now, on the progress line."""
        self._progress.update(self._task, summary=text)

    def log(self, kind: str, step: int, values: dict[str, Any]) -> dict[str, Any]:
        record = {"kind": kind, "step": step, "time": time.time()}
        record.update({k: _clean(v) for k, v in values.items()})
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if kind == "train":
            self._progress.update(self._task, completed=step, summary=_summary(record))
        else:
            self.console.log(
                f"eval at step {step}: accuracy {_pct(record.get('accuracy'))}, "
                f"mean reward {_num(record.get('reward_mean'))}"
            )
        return record

    def plot(self, path: Path | None = None) -> Path:
        """Reward (train rollouts) and held-out accuracy over steps, as a PNG."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = path or self.path.parent / "reward.png"
        train = [r for r in self.records if r["kind"] == "train"]
        evals = [r for r in self.records if r["kind"] == "eval"]
        fig, ax = plt.subplots(figsize=(7, 4))
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
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def state_dict(self) -> dict:
        return {"records": self.records}

    def load_state_dict(self, state: dict) -> None:
        """Back to the checkpoint's records; steps logged after it are dropped (they run
        again)."""
        self.records = list(state["records"])
        # Atomically: killed here, the file still holds every step up to the checkpoint.
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        os.replace(tmp, self.path)
        steps = [r["step"] for r in self.records if r["kind"] == "train"]
        self._progress.update(self._task, completed=max(steps, default=0))


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
