"""Diagnostics on a live run: a real `looprl train` subprocess asked for its stacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.train_process import seeded_train_command, wait_for_log


@pytest.mark.slow
def test_debug_stacks_of_a_running_training_process(tiny_model_dir, tmp_path):
    """`looprl debug stacks RUN_DIR` prints the threads of a live run; the run goes on."""
    cwd = Path(__file__).resolve().parents[2]
    command = seeded_train_command(tiny_model_dir, tmp_path, "stacks", "train.total_steps=200")
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    run_dir = tmp_path / "default" / "stacks"
    try:
        assert wait_for_log(run_dir / "train.log", 0, "checkpoint for step 1 to", proc)
        for target in (str(run_dir), str(proc.pid)):
            shown = subprocess.run(
                [sys.executable, "-m", "looprl.cli", "debug", "stacks", target],
                cwd=cwd,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert shown.returncode == 0, shown.stderr
            assert "Current thread" in shown.stdout or "Thread 0x" in shown.stdout
            assert "looprl" in shown.stdout  # frames of our own code
            assert proc.poll() is None  # asking did not stop it
    finally:
        proc.kill()
        proc.wait()
    missing = subprocess.run(
        [sys.executable, "-m", "looprl.cli", "debug", "stacks", str(tmp_path)],
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    said = " ".join(missing.stderr.split())  # the console wraps long lines
    assert missing.returncode == 2 and "neither a pid nor a run dir with driver.pid" in said
