"""What a run directory keeps: a real `looprl train` subprocess on the tiny model.

A run cut short by SIGTERM keeps exactly its newest recover checkpoint (with
`checkpoint.save_every_steps=1` and the default `checkpoint.keep_last=1`, each save
removes the one before) and the next run resumes from it; a run that finishes keeps its
model, metrics, plot and trajectories and no recover checkpoint. The first run has
`recover.mode=off`, as `make demo`: it still saves while running, and its stop message
says how to resume.
"""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import pytest

from looprl.runs import checkpoint as checkpoint_io
from tests.support.tiny_run import metrics_records
from tests.support.train_process import seeded_train_command, wait_for_log

STEPS = 5  # stopped after step 2 or 3, the rest trained by the resumed run


@pytest.mark.slow
def test_a_stopped_run_keeps_its_newest_checkpoint_and_a_finished_one_none(
    tiny_model_dir, tmp_path
):
    cwd = Path(__file__).resolve().parents[2]
    run_dir = tmp_path / "default" / "kept"
    log_file = run_dir / "train.log"

    stopped = subprocess.Popen(
        seeded_train_command(
            tiny_model_dir, tmp_path, "kept", f"train.total_steps={STEPS}", "recover.mode=off"
        ),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert wait_for_log(log_file, 0, "Saved recover checkpoint for step 2", stopped)
    stopped.send_signal(signal.SIGTERM)
    out, _ = stopped.communicate(timeout=120)
    assert stopped.returncode == 128 + signal.SIGTERM, out.decode()[-2000:]
    said = " ".join(out.decode().split())  # rich wraps the message at the terminal width
    assert "the same command with recover.mode=auto resumes from it" in said
    text = log_file.read_text()
    last = max(map(int, re.findall(r"Saved recover checkpoint for step (\d+)", text)))
    assert 2 <= last < STEPS
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == ["latest", f"step_{last:06d}"]
    assert (
        f"Removed recover checkpoint step_{last - 1:06d} (" in text
        and "checkpoint.keep_last=1 keeps the newest" in text
    )
    assert "Run finished" not in text

    offset = log_file.stat().st_size
    resumed = subprocess.run(
        seeded_train_command(tiny_model_dir, tmp_path, "kept", f"train.total_steps={STEPS}"),
        cwd=cwd,
        capture_output=True,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stdout.decode()[-2000:]
    with log_file.open() as f:
        f.seek(offset)
        text = f.read()
    assert f"Resumed from {run_dir / 'checkpoints' / f'step_{last:06d}'}: step {last}" in text
    assert re.search(
        rf"Run finished: removed recover checkpoint step_{STEPS:06d} \(\d+(\.\d)? MB; "
        r"keep them with checkpoint.keep_on_finish=true\)",
        text,
    ), text[-3000:]

    assert not (run_dir / "checkpoints").exists()
    assert checkpoint_io.load_latest(run_dir) is None
    assert (run_dir / "model" / "model.safetensors").is_file()
    assert (run_dir / "reward.png").stat().st_size > 0
    steps = [r["step"] for r in metrics_records(run_dir, "train")]
    assert steps == list(range(1, STEPS + 1))  # each step once, across the stop
    trajectories = sorted(p.name for p in (run_dir / "trajectories").glob("step_*.parquet"))
    assert trajectories == [f"step_{s:06d}.parquet" for s in range(1, STEPS + 1)]

    # The same command again (a scheduler's retry): the trial finished, so it says so with
    # its result and succeeds, training nothing, its model untouched.
    model = (run_dir / "model" / "model.safetensors").stat().st_mtime_ns
    again = subprocess.run(
        seeded_train_command(tiny_model_dir, tmp_path, "kept", f"train.total_steps={STEPS}"),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=120,
    )
    said = " ".join(again.stdout.decode().split())
    assert again.returncode == 0, said[-2000:]
    assert "This trial already finished: held-out accuracy:" in said, said[-2000:]
    assert (run_dir / "model" / "model.safetensors").stat().st_mtime_ns == model
