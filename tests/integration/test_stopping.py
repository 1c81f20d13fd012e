"""`looprl train` with a user's own broken agent, as a newcomer writes one: a workflow
that always raises stops the run (exit 1, its own file and line); one that fails now and
then does not; and the first SIGTERM ends the run within about a step's time whether
the workflow fails, hangs or blocks the event loop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from looprl.runs.stopping import GracefulStop
from tests.support.tiny_run import tiny_run_overrides

ROOT = Path(__file__).resolve().parents[2]

AGENT = '''\
import asyncio
import time

from openai import AsyncOpenAI


class Raises:
    async def run(self, data, **kw):
        return lookup(data)


def lookup(data):
    return data["missing_key"]


class Hangs:
    async def run(self, data, **kw):
        await asyncio.sleep(10_000)


class Blocks:
    async def run(self, data, **kw):
        time.sleep(10_000)


class Flaky:
    """Raises in one rollout of four; answers through the model otherwise."""

    calls = 0

    async def run(self, data, base_url, api_key, model, **kw):
        Flaky.calls += 1
        if Flaky.calls % 4 == 0:
            raise RuntimeError("flaky")
        client = AsyncOpenAI(base_url=base_url, api_key=api_key)
        reply = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": data["question"]}], max_tokens=4
        )
        return float(len(reply.choices[0].message.content or "") % 2)
'''


def _start(tiny_model_dir, tmp_path: Path, agent: str, *overrides: str) -> subprocess.Popen:
    (tmp_path / "my_agent.py").write_text(AGENT)
    command = [
        sys.executable,
        "-m",
        "looprl.cli",
        "train",
        *tiny_run_overrides(
            tiny_model_dir,
            tmp_path / "runs",
            f"workflow.path=my_agent:{agent}",
            "eval.size=4",
            "train.total_steps=4",
            *overrides,
        ),
    ]
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "COLUMNS": "200", "NO_COLOR": "1"}
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _log(tmp_path: Path) -> Path:
    return tmp_path / "runs" / "default" / "trial0" / "train.log"


def _wait_for(tmp_path: Path, text: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not (_log(tmp_path).exists() and text in _log(tmp_path).read_text()):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"no {text!r} in train.log"
        time.sleep(0.1)


def _stop(proc: subprocess.Popen) -> tuple[str, float]:
    """SIGTERM once; (output, seconds until it exited)."""
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    return out, time.monotonic() - sent


def test_a_workflow_that_always_raises_stops_the_run_with_its_own_traceback(
    tiny_model_dir, tmp_path
):
    started = time.monotonic()
    proc = _start(tiny_model_dir, tmp_path, "Raises")
    out, _ = proc.communicate(timeout=180)
    said = " ".join(out.split())  # the console wraps long lines
    assert proc.returncode == 1, out[-3000:]
    agent = tmp_path / "my_agent.py"
    assert f'File "{agent}", line 9, in run' in out  # the user's frames, with lines
    assert f'File "{agent}", line 13, in lookup' in out
    assert "KeyError: 'missing_key'" in out
    assert "looprl/rollout" not in out.split("Its own traceback")[1].split("Fix the")[0]
    # The first 4 rollouts (the held-out evaluation's) all failed: more than half of the
    # window of 2 x 2; nothing was retried past it.
    assert "The workflow failed 4 of the last 4 rollouts" in said
    assert "KeyError x4" in said
    assert f"{agent}:13 in lookup" in said  # the first error's warning names where
    assert "stopped: the workflow failed too often" in said
    assert "Hang" not in out
    assert "Its own traceback" in _log(tmp_path).read_text()
    assert time.monotonic() - started < 120


def test_a_workflow_failing_now_and_then_trains_to_the_end(tiny_model_dir, tmp_path):
    proc = _start(tiny_model_dir, tmp_path, "Flaky")
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    assert "A rollout ended with RuntimeError: flaky at" in " ".join(out.split())
    assert "held-out accuracy" in out


def test_the_first_sigterm_interrupts_a_workflow_blocking_the_event_loop(tiny_model_dir, tmp_path):
    proc = _start(tiny_model_dir, tmp_path, "Blocks")
    _wait_for(tmp_path, "Gateway listening", proc)
    time.sleep(1)  # the evaluation's first workflow is in time.sleep
    out, took = _stop(proc)
    said = " ".join(out.split())
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "while a workflow blocked the event loop for" in said
    line = AGENT.splitlines().index("        time.sleep(10_000)") + 1
    assert f"{tmp_path / 'my_agent.py'}:{line} in run" in said  # where it blocks
    assert "there is no checkpoint to resume from" in said
    assert "Traceback" not in out, out[-3000:]
    assert took < GracefulStop.BLOCKED_S + 15, took


@pytest.mark.slow
def test_the_first_sigterm_stops_a_hanging_workflow_within_the_grace(tiny_model_dir, tmp_path):
    proc = _start(tiny_model_dir, tmp_path, "Hangs")  # rollout.timeout_s is 300 s
    _wait_for(tmp_path, "Gateway listening", proc)
    out, took = _stop(proc)
    said = " ".join(out.split())
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "did not finish within 30 s of the signal" in said
    assert "stopped by SIGTERM before the first step was trained" in said
    assert "Traceback" not in out, out[-3000:]
    assert GracefulStop.FIRST_GRACE_S <= took < GracefulStop.FIRST_GRACE_S + 20, took


@pytest.mark.slow
def test_the_first_sigterm_stops_a_run_retrying_failing_rollouts(tiny_model_dir, tmp_path):
    """With the failure budget off, failing rollouts are retried for ever; the watchdog
    says the driver is busy with them, not hung, and the SIGTERM stops the run."""
    proc = _start(
        tiny_model_dir,
        tmp_path,
        "Raises",
        "rollout.max_failure_share=1",
        "diagnostics.hang_timeout_s=3",
        "rollout.timeout_s=2",
    )
    _wait_for(tmp_path, "No hang: driver made no training progress", proc)
    out, took = _stop(proc)
    said = " ".join(out.split())
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "of them failed (KeyError x" in said
    assert "stopped by SIGTERM before the first step was trained" in said
    assert not (_log(tmp_path).parent / "hangs").exists()  # no stacks: nothing hung
    assert took < GracefulStop.FIRST_GRACE_S + 20, took
