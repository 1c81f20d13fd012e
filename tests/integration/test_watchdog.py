"""The hang watchdog on real processes: one report per stall, exited and reused pids,
and `looprl train` whose workflow blocks the event loop, reported and aborted."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from looprl.config import DiagnosticsConfig
from looprl.diagnostics.watchdog import HangWatchdog, registered
from looprl.rollout.failures import FailureBudget

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "COLUMNS": "400", "NO_COLOR": "1"}


def _line_of(marker: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.endswith(f"# {marker}"))


def _wait_for_reports(run_dir: Path, count: int, timeout_s: float = 10) -> list[Path]:
    deadline = time.monotonic() + timeout_s
    while len(reports := sorted((run_dir / "hangs").glob("hang-*.txt"))) < count:
        assert time.monotonic() < deadline, f"{len(reports)} hang reports, not {count}"
        time.sleep(0.05)  # STALLS
    return reports


def test_a_stall_is_reported_once_and_a_beat_rearms_the_watchdog(tmp_path):
    diagnostics = DiagnosticsConfig(hang_timeout_s=0.5, collective_timeout_s=60)
    with HangWatchdog(tmp_path, "driver", diagnostics) as watchdog:
        started = time.monotonic()
        first = _wait_for_reports(tmp_path, 1)[0]
        assert 0.5 <= time.monotonic() - started < 3
        time.sleep(2.0)  # four more timeouts without a beat: still the same stall
        assert len(_wait_for_reports(tmp_path, 1)) == 1
        watchdog.beat()
        _wait_for_reports(tmp_path, 2)
    report = first.read_text()
    assert (
        "No process waits in a collective: driver is outside any collective, at "
        f"{__file__}:{_line_of('STALLS')} in _wait_for_reports." in report
    )
    assert "looprl/diagnostics/watchdog.py" in report  # every thread is there, the watchdog's too
    assert registered(tmp_path)[0].pid == os.getpid()


def test_exited_processes_are_named_and_a_reused_pid_is_not_signalled(tmp_path):
    """A registered rank that exited is reported as such; a pid now held by another
    process (its start time differs) is not sent SIGUSR1, which would end it."""
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "processes").mkdir()
        for rank, pid, ticks in ((0, stranger.pid, "1"), (1, _dead_pid(), None)):
            entry = dict(name=f"rank-{rank}", pid=pid, role="rank", rank=rank, start_ticks=ticks)
            entry["host"] = os.uname().nodename
            (tmp_path / "processes" / f"rank-{rank}.json").write_text(json.dumps(entry))
        diagnostics = DiagnosticsConfig(hang_timeout_s=0.3, collective_timeout_s=60)
        with HangWatchdog(tmp_path, "driver", diagnostics):
            report = _wait_for_reports(tmp_path, 1)[0].read_text()
        assert "No process waits in a collective: rank 0 has exited, rank 1 has exited." in report
        assert "driver: is outside any collective, at " in report  # listed, not judged
        assert stranger.poll() is None  # not signalled
    finally:
        stranger.kill()
        stranger.wait()


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


async def blocking_agent(data: dict, **kw) -> float:
    """A workflow bug: a synchronous call that holds the event loop, so nothing (not even
    rollout.timeout_s) can run."""
    time.sleep(600)  # BLOCKS
    return 0.0


def test_a_workflow_blocking_the_event_loop_is_reported_and_aborts_the_run(
    tiny_model_dir, tmp_path
):
    command = [
        sys.executable,
        "-m",
        "looprl.cli",
        "train",
        f"model.path={tiny_model_dir}",
        "workflow.path=tests.integration.test_watchdog:blocking_agent",
        f"run.fileroot={tmp_path}",
        "rollout.batch_size=1",
        "rollout.group_size=1",
        "rollout.timeout_s=1",
        "eval.size=1",
        "diagnostics.hang_timeout_s=2",
        "diagnostics.hang_abort=true",
    ]
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    said = " ".join(done.stderr.split())  # the console wraps long lines
    assert done.returncode == 1, done.stderr[-3000:]
    assert (
        "No process waits in a collective: driver is outside any collective, at "
        f"{__file__}:{_line_of('BLOCKS')} in blocking_agent." in said
    )
    assert "Stopping the run (diagnostics.hang_abort=true)" in said
    run_dir = tmp_path / "default" / "trial0"
    assert len(list((run_dir / "hangs").glob("hang-*.txt"))) == 1
    assert "Hang: driver made no progress" in (run_dir / "train.log").read_text()
    assert elapsed < 60, elapsed  # not the workflow's 600 s


def test_a_driver_busy_with_failing_rollouts_is_named_and_not_reported_as_a_hang(tmp_path, caplog):
    diagnostics = DiagnosticsConfig(hang_timeout_s=0.5, collective_timeout_s=60)
    budget = FailureBudget(max_failure_share=1.0, window=4)  # retried for ever
    with (
        caplog.at_level(logging.WARNING, logger="looprl.diagnostics.watchdog"),
        HangWatchdog(tmp_path, "driver", diagnostics, busy=budget.activity),
    ):
        busy_until = time.monotonic() + 2.0  # four timeouts of failing rollouts
        while time.monotonic() < busy_until:
            budget.record("failed", "KeyError: 'missing_key'")
            time.sleep(0.05)
        assert not (tmp_path / "hangs").exists()  # no stacks asked, nothing blamed
        assert "No hang: driver made no training progress for" in caplog.text
        assert "of them failed (KeyError x" in caplog.text
        _wait_for_reports(tmp_path, 1)  # once nothing finishes any more: a hang
