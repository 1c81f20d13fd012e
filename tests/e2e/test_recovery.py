"""Automatic recovery: a real `looprl train` subprocess, SIGKILLed at random moments.

The run is synchronous, seeded (`rollout.seeded`: every rollout's sampling seed comes
from run.seed and its admission order) and float32 on the tiny model, so an interrupted
run that resumes from its checkpoints must end with the weights of an uninterrupted one.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from looprl import checkpoint as checkpoint_io

STEPS = 8


def _command(model_dir: Path, root: Path, trial: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "looprl.cli",
        "train",
        f"model.path={model_dir}",
        "workflow.path=tests.e2e.test_learning:EvenTokenAgent",
        f"run.fileroot={root}",
        f"run.trial_name={trial}",
        "engine.dtype=float32",
        "train.compute_dtype=float32",
        "train.lr=3e-3",
        f"train.total_steps={STEPS}",
        "rollout.batch_size=2",
        "rollout.group_size=4",
        "rollout.seeded=true",
        "sampling.max_new_tokens=8",
        "eval.every_steps=0",
        "eval.size=2",
        "eval.max_new_tokens=4",
        "checkpoint.save_every_steps=1",
    ]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "model" / "model.safetensors")


def _train_steps(run_dir: Path) -> list[int]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return [r["step"] for r in records if r["kind"] == "train"]


def _wait_for_log(log_file: Path, offset: int, text: str, proc: subprocess.Popen) -> bool:
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


@pytest.mark.slow
def test_sigkill_at_random_moments_loses_nothing(tiny_model_dir, tmp_path):
    cwd = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        _command(tiny_model_dir, tmp_path, "whole"), cwd=cwd, capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    reference = _weights(tmp_path / "default" / "whole")

    # Each kill lands at a random moment after a random event of the attempt: its start
    # (model loading, evaluation), or the save of a step still ahead of the newest
    # checkpoint (the next step, or the next save, in progress). Events stop 2 steps
    # before the end, so every attempt is killed while it still has work left.
    run_dir = tmp_path / "default" / "killed"
    log_file = run_dir / "train.log"
    rng = random.Random(0)
    kills, saved_step, log = 0, 0, b""
    while True:
        offset = log_file.stat().st_size if log_file.exists() else 0
        proc = subprocess.Popen(
            _command(tiny_model_dir, tmp_path, "killed"),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        if kills < 10:
            ahead = list(range(saved_step + 1, STEPS - 1))
            event = rng.choice(["Training "] + [f"checkpoint for step {k} to" for k in ahead])
            assert _wait_for_log(log_file, offset, event, proc), f"ended before {event!r}"
            time.sleep(rng.uniform(0.0, 0.6))
            assert proc.poll() is None, "the attempt finished before its kill"
            proc.send_signal(signal.SIGKILL)
            kills += 1
        out, _ = proc.communicate(timeout=300)
        log += out
        found = checkpoint_io.load_latest(run_dir)
        if found is not None:
            assert checkpoint_io.verify(found.path) is None
            assert found.step >= saved_step  # never behind a checkpoint already written
            saved_step = found.step
            # Every step up to the checkpoint is in the metrics, once.
            assert _train_steps(run_dir)[: found.step] == list(range(1, found.step + 1))
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, out.decode()[-2000:]
    assert kills == 10
    assert b"Resumed from" in log
    assert _train_steps(run_dir) == list(range(1, STEPS + 1))
    weights = _weights(run_dir)
    for name, tensor in reference.items():
        assert torch.allclose(weights[name], tensor, atol=1e-5, rtol=0), name


@pytest.mark.slow
def test_sigterm_saves_and_stops_after_the_step(tiny_model_dir, tmp_path):
    cwd = Path(__file__).resolve().parents[2]
    command = [*_command(tiny_model_dir, tmp_path, "term"), "checkpoint.save_every_steps=0"]
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    log_file = tmp_path / "default" / "term" / "train.log"
    assert _wait_for_log(log_file, 0, "Saved recover checkpoint for step 2", proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out.decode()[-2000:]
    text = log_file.read_text()
    assert "Received SIGTERM: stopping after this step with a checkpoint" in text
    found = checkpoint_io.load_latest(log_file.parent)
    assert 3 <= found.step < STEPS  # the step in flight finished and was saved
    assert f"Saved recover checkpoint for step {found.step} to" in text
    assert _train_steps(log_file.parent) == list(range(1, found.step + 1))
    assert b"the same command resumes from it" in out
