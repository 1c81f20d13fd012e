"""TensorBoard: event files in `log_dir`, the run's tensorboard/ (`RunPaths.tensorboard`;
`tensorboard --logdir` on it).

Scalars by name and step; the config as hyperparameters (the HParams tab) and as text;
samples as Markdown text, one section per rollout. Written with torch's SummaryWriter
(needs the tensorboard package: `pip install 'looprl[tensorboard]'`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, log_dir: Path, *, purge_step: int | None = None):
        """`purge_step`: on a resume, events at this step and later (written before the
        crash, and about to be written again) are hidden."""
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def log_config(self, config: dict[str, Any]) -> None:
        # HParams takes numbers, strings and bools; lists and None as their JSON.
        simple = {
            k: v if isinstance(v, int | float | str | bool) else json.dumps(v)
            for k, v in config.items()
        }
        for summary in hparams(simple, {}):  # experiment, session start, session end
            self.writer.file_writer.add_summary(summary)
        lines = "\n".join(f"    {k}: {json.dumps(v)}" for k, v in config.items())
        self.writer.add_text("config", lines, 0)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.writer.add_text("samples", "\n\n".join(_markdown(row) for row in rows), step)

    def finish(self) -> None:
        self.writer.close()


def _markdown(row: dict[str, Any]) -> str:
    """A rollout as Markdown: reward, advantage and group as a heading, the prompt and
    completion as code blocks (kept verbatim)."""
    heading = ", ".join(
        f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}"
        for k, v in row.items()
        if k not in ("prompt", "completion")
    )
    texts = [f"**{k}**\n\n{_indent(row[k])}" for k in ("prompt", "completion")]
    return "\n\n".join([f"#### {heading}", *texts])


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines() or [""])
