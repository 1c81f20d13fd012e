"""A real `looprl train` subprocess on the tiny model, as the recovery and diagnostics
tests start it, and a wait for a line of its log."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.support.tiny_run import tiny_run_overrides
from tests.support.toy_job import EVEN_TOKEN_AGENT

SEEDED_STEPS = 8


def seeded_train_command(model_dir: Path, root: Path, trial: str, *overrides: str) -> list[str]:
    """`looprl train` of SEEDED_STEPS synchronous, seeded steps of 2 x 4 rollouts,
    rewarded by EvenTokenAgent, with a checkpoint after each step; `overrides` win."""
    return [
        sys.executable,
        "-m",
        "looprl.cli",
        "train",
        *tiny_run_overrides(
            model_dir,
            root,
            f"workflow.path={EVEN_TOKEN_AGENT}",
            f"run.trial_name={trial}",
            "train.lr=3e-3",
            f"train.total_steps={SEEDED_STEPS}",
            "rollout.group_size=4",
            "rollout.seeded=true",
            "sampling.max_new_tokens=8",
            "eval.size=2",
            "checkpoint.save_every_steps=1",
            *overrides,
        ),
    ]


def wait_for_log(log_file: Path, offset: int, text: str, proc: subprocess.Popen) -> bool:
    """Wait until `text` appears in `log_file` after byte `offset`; False if `proc` ended."""
    deadline = time.monotonic() + 120
    while True:
        if log_file.exists():
            with log_file.open("rb") as f:
                f.seek(offset)
                if text.encode() in f.read():
                    return True
        if proc.poll() is not None:
            return False
        assert time.monotonic() < deadline, f"no {text!r} in {log_file} after 120 s"
        time.sleep(0.02)
