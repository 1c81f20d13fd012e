"""The failure budget (rollout/failures.py) and the workflow's own traceback
(rollout/outcome.py `user_traceback`), with hand-counted windows."""

from __future__ import annotations

import asyncio
import time

import pytest

from looprl.config import RolloutConfig
from looprl.rollout.failures import FailureBudget, WorkflowFailed, where
from looprl.rollout.outcome import run_workflow

TRACEBACK = """Traceback (most recent call last):
  File "/home/me/agent.py", line 9, in run
    return lookup(data)
  File "/home/me/agent.py", line 13, in lookup
    return data["missing_key"]
KeyError: 'missing_key'
"""


def test_the_budget_stops_past_its_share_of_the_window_and_not_at_it():
    budget = FailureBudget(max_failure_share=0.5, window=4)
    for status in ("failed", "completed", "failed", "completed"):
        budget.record(status, "KeyError: 'k'" if status == "failed" else None)
    assert not budget.exceeded()  # 2 of 4 is the share, not more
    budget.record("timed_out", "TimeoutError: no result after 1 s")
    # The window is the last 4: completed, failed, completed, timed_out -> 2: still not.
    assert not budget.exceeded()
    budget.record("failed", "KeyError: 'k'")
    assert budget.exceeded()  # failed, completed, timed_out, failed: 3 > 0.5 x 4
    with pytest.raises(WorkflowFailed, match=r"failed 3 of the last 4 rollouts"):
        budget.check()


def test_rejected_rollouts_are_not_failures_and_share_one_never_stops():
    budget = FailureBudget(max_failure_share=0.5, window=4)
    for _ in range(8):
        budget.record("rejected", None)
    assert not budget.exceeded()
    never = FailureBudget(max_failure_share=1.0, window=4)
    for _ in range(8):
        never.record("failed", "KeyError: 'k'")
    assert not never.exceeded()


def test_the_message_counts_errors_and_shows_the_most_common_ones_traceback():
    budget = FailureBudget(max_failure_share=0.5, window=4)
    budget.record("failed", "ValueError: once", "Traceback ...\nValueError: once\n")
    for _ in range(3):
        budget.record("failed", "KeyError: 'missing_key'", TRACEBACK)
    message = budget.explain()
    assert "failed 4 of the last 4 rollouts" in message
    assert "KeyError x3, ValueError x1" in message
    assert "Its own traceback (KeyError, the first one):" in message
    assert 'File "/home/me/agent.py", line 13, in lookup' in message
    assert "rollout.max_failure_share" in message and "looprl debug workflow" in message


def test_a_timeout_is_counted_by_its_kind_without_a_traceback():
    budget = FailureBudget(max_failure_share=0.5, window=2)
    budget.record("timed_out", "TimeoutError: no result after 1 s")
    budget.record("timed_out", "TimeoutError: no result after 1 s")
    message = budget.explain()
    assert "TimeoutError x2" in message
    assert "The first TimeoutError: TimeoutError: no result after 1 s" in message


def test_activity_counts_what_finished_since_a_time():
    budget = FailureBudget(max_failure_share=0.5, window=4)
    budget.record("completed", None)
    since = time.monotonic()
    assert budget.activity(since) is None
    budget.record("failed", "KeyError: 'k'")
    budget.record("completed", None)
    budget.record("failed", "KeyError: 'k'")
    assert budget.activity(since) == (
        "3 rollout(s) finished in that time, 2 of them failed (KeyError x2)"
    )


def test_where_is_the_innermost_frame():
    assert where(TRACEBACK) == "/home/me/agent.py:13 in lookup"
    assert where(None) is None and where("KeyError: 'k'") is None


def test_the_window_defaults_to_a_step_and_at_least_two_groups():
    assert RolloutConfig(batch_size=8, group_size=4).failure_window_rollouts() == 32
    assert RolloutConfig(batch_size=1, group_size=4).failure_window_rollouts() == 8
    assert RolloutConfig(group_size=4, failure_window=9).failure_window_rollouts() == 9
    with pytest.raises(ValueError, match="less than two groups"):
        RolloutConfig(group_size=4, failure_window=7)


class _Agent:
    async def run(self, data, **kw):
        return _lookup(data)


def _lookup(data):
    return data["missing_key"]  # RAISES


def test_run_workflow_keeps_the_users_frames_only():
    run = asyncio.run(
        run_workflow(_Agent(), {}, base_url="http://x", api_key="k", model="m", timeout_s=5)
    )
    assert run.status == "failed" and run.error == "KeyError: 'missing_key'"
    frames = [line for line in run.traceback.splitlines() if line.startswith("  File ")]
    assert len(frames) == 2, run.traceback  # run, then _lookup: no asyncio, no looprl
    assert all(__file__ in line for line in frames)
    assert run.traceback.startswith("Traceback (most recent call last):")
    assert run.traceback.rstrip().endswith("KeyError: 'missing_key'")
    assert where(run.traceback).endswith("test_failures.py:" + str(_line("RAISES")) + " in _lookup")


def _line(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if line.rstrip().endswith(f"# {marker}"))
