"""What rollouts come to: each one's outcome, a batch's result and summary, and the one
way a workflow is run (its timeout, its errors captured) and its reward checked.

`run_workflow` is used by the controller for every rollout (through `run_in_session`,
as `looprl debug workflow` on its own engine) and by `looprl debug workflow` against any
server; it runs the workflow in a task of its own, so that
`in_workflow()` tells a signal handler whether the code blocking the event loop is a
workflow's, and `stop_workflows(loop)` keeps workflows queued on a loop whose run is
stopping from starting their code; `check_reward` is the one rule for what a workflow may
return: a finite float, a dict of them by completion id, an EpisodeReward (such a dict
and the rollout's total), or None (rejected).
"""

from __future__ import annotations

import asyncio
import math
import time
import traceback
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from looprl.rollout.staleness import sample_staleness
from looprl.types import EpisodeReward, Interaction, SessionHandle, Trajectory
from looprl.workflows.protocol import Workflow

Status = Literal["completed", "rejected", "failed", "timed_out"]


@dataclass(frozen=True)
class WorkflowRun:
    """One call of a workflow: `value` what it returned (status completed), else `error`
    ("Type: message") and, for an exception the workflow raised, `traceback`: its frames
    from the workflow's own code down (`user_traceback`)."""

    status: Literal["completed", "failed", "timed_out"]
    value: Any
    error: str | None
    started: float  # time.monotonic() at the start
    elapsed_s: float
    traceback: str | None = None


async def run_workflow(
    workflow: Workflow,
    row: dict,
    *,
    base_url: str,
    api_key: str,
    model: str,
    timeout_s: float,
    reward_key: str | None = None,
) -> WorkflowRun:
    """Run `workflow` on `row` against the endpoint (`reward_key`: the gateway session's
    key for posting a reward, None against another server); user code: whatever it
    raises or however long it hangs (cancelled at `timeout_s`) is captured, never raised."""
    start = time.monotonic()
    kw = dict(base_url=base_url, api_key=api_key, model=model, reward_key=reward_key)
    task = asyncio.ensure_future(_workflow_task(workflow, row, kw))
    _workflow_tasks.add(task)
    try:
        value = await asyncio.wait_for(task, timeout=timeout_s)
    except TimeoutError:
        error = f"TimeoutError: no result after {timeout_s} s"
        return WorkflowRun("timed_out", None, error, start, time.monotonic() - start)
    except Exception as e:  # user code: counted; the failure budget decides what stops
        error = f"{type(e).__name__}: {e}"
        elapsed = time.monotonic() - start
        return WorkflowRun("failed", None, error, start, elapsed, user_traceback(e))
    return WorkflowRun("completed", value, None, start, time.monotonic() - start)


_workflow_tasks: weakref.WeakSet[asyncio.Future] = weakref.WeakSet()
_stopped_loops: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


async def _workflow_task(workflow: Workflow, row: dict, kw: dict[str, Any]) -> Any:
    if asyncio.get_running_loop() in _stopped_loops:
        raise asyncio.CancelledError  # queued before the run stopped: never starts
    return await workflow.run(row, **kw)


def in_workflow() -> bool:
    """Whether the code running on this thread's event loop now is a workflow's (a
    signal handler asks: it runs inside whatever code the main thread runs)."""
    try:
        return asyncio.current_task() in _workflow_tasks
    except RuntimeError:  # no running loop
        return False


def stop_workflows(loop: asyncio.AbstractEventLoop) -> None:
    """No workflow queued on `loop` starts its code from now on: each is cancelled at its
    start instead (the run is stopping)."""
    _stopped_loops.add(loop)


# Frames of these folders above the workflow's own are how it was called, not what failed.
_CALLERS = (str(Path(__file__).parents[1]), str(Path(asyncio.__file__).parent))


def user_traceback(error: BaseException) -> str:
    """The traceback of `error` as Python prints it, without the frames of looprl and
    asyncio that called the workflow: it starts at the workflow's own code (a frame of
    theirs below it, e.g. the openai client's, stays). Chained exceptions are kept."""
    frames = traceback.extract_tb(error.__traceback__)
    first = next(
        (i for i, f in enumerate(frames) if not f.filename.startswith(_CALLERS)), len(frames)
    )
    lines = traceback.format_exception(error)
    # format_exception puts the last exception's frames after "Traceback ..." at the end;
    # only those are trimmed: a chained cause's frames are all the user's.
    own = traceback.format_list(frames[first:])
    tail = traceback.format_exception_only(error)
    head_end = len(lines) - len(frames) - len(tail)
    if lines[head_end : head_end + len(frames)] != traceback.format_list(frames):
        return "".join(lines)  # a recursion's "[Previous line repeated ...]": all of it
    return "".join(lines[:head_end] + own + tail)


class RecordedSession(Protocol):
    """What a closed session recorded: its calls, a posted reward, unparseable calls."""

    interactions: list[Interaction]
    reward: float | dict[str, float] | None
    tool_call_errors: int


class SessionHost(Protocol):
    """Where rollouts get their OpenAI endpoint: the gateway."""

    def open_session(self, sampling_overrides: dict[str, Any] | None = None) -> SessionHandle: ...

    def close_session(self, session_id: str) -> RecordedSession: ...


async def run_in_session(
    host: SessionHost,
    workflow: Workflow,
    row: dict,
    sampling_overrides: dict[str, Any] | None,
    *,
    model: str,
    timeout_s: float,
) -> tuple[WorkflowRun, RecordedSession, SessionHandle]:
    """One run of `workflow` on `row` in a session of `host` opened for it (and closed,
    whatever the workflow did): what it returned or raised, what the session recorded,
    and the session's handle. The one way a rollout and `looprl debug workflow` run."""
    handle = host.open_session(sampling_overrides)
    try:
        run = await run_workflow(
            workflow,
            row,
            base_url=handle.base_url,
            api_key=handle.api_key,
            reward_key=handle.reward_key,
            model=model,
            timeout_s=timeout_s,
        )
    finally:
        session = host.close_session(handle.id)
    return run, session, handle


def check_reward(
    value: Any,
) -> tuple[float | dict[str, float] | EpisodeReward | None, str | None]:
    """Validate a workflow's result: (reward, None) or (None, error message)."""
    if value is None:
        return None, None
    if isinstance(value, EpisodeReward):
        per_call, error = check_reward(value.per_call)
        total, total_error = check_reward(value.total)
        if error or total_error:
            return None, error or f"{total_error} (EpisodeReward.total)"
        per_step = None
        if value.per_step is not None:
            per_step, step_error = check_reward(value.per_step)
            if step_error:
                return None, f"{step_error} (EpisodeReward.per_step)"
        return EpisodeReward(per_call, total, value.success, per_step), None
    if isinstance(value, dict):
        rewards = {}
        for key, r in value.items():
            checked, error = check_reward(r)
            if error or checked is None:
                return None, f"InvalidReward: reward for completion {key!r}: {error or r!r}"
            rewards[str(key)] = checked
        return (rewards, None) if rewards else (None, "InvalidReward: empty reward dict")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None, (
            f"InvalidReward: the workflow returned {value!r} "
            f"({type(value).__name__}); return a float, a dict or None"
        )
    if not math.isfinite(value):
        return None, f"InvalidReward: the workflow returned a non-finite reward {value!r}"
    return float(value), None


@dataclass
class RolloutOutcome:
    """What became of one rollout."""

    group_id: str
    status: Status
    trajectories: list[Trajectory] = field(default_factory=list)
    reward: float | None = None
    error: str | None = None
    elapsed_s: float = 0.0
    started: float = 0.0  # time.monotonic() at the start
    sampled_tokens: int = 0
    export_stats: dict[str, int] = field(default_factory=dict)
    success: bool | None = None  # an EpisodeReward's; None: accuracy counts reward >= 1
    # What the trajectory files keep besides the trajectories (trajectory_files.py):
    row_id: str = ""  # the dataset row's "id", else its position in the data stream
    sample_index: int = 0  # the rollout's index in its group
    calls: list[dict] = field(default_factory=list)  # trajectory.call_records
    concat_breaks: list[str] = field(default_factory=list)  # why each concatenation broke
    traceback: str | None = None  # a workflow that raised: its own frames (user_traceback)


@dataclass
class RolloutResult:
    """The outcomes of a set of rollouts and their summary."""

    outcomes: list[RolloutOutcome]
    elapsed_s: float
    dropped: dict[str, int] = field(default_factory=dict)  # groups left out, by reason
    # Rollouts that finished meanwhile in groups not returned: all failed or rejected,
    # filtered, or too stale. Their outcomes count; their rewards and tokens do not.
    left_out: list[RolloutOutcome] = field(default_factory=list)

    # The policy version when the batch was taken for training (None: not for training):
    # each sample's staleness is measured against it.
    version: int | None = None

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for o in self.outcomes for t in o.trajectories]

    def stats(self) -> dict[str, Any]:
        stats = summarize(self.outcomes, self.elapsed_s)
        left = summarize(self.left_out, self.elapsed_s)
        for key in ("rollouts", "rejected", "failed", "timed_out"):
            stats[key] += left[key]
        stats["errors"] = dict(Counter(stats["errors"]) + Counter(left["errors"]))
        stats["left_out_rollouts"] = left["rollouts"]
        stats["dropped_stale_groups"] = self.dropped.get("dropped_stale_groups", 0)
        stats["filtered_groups"] = self.dropped.get("filtered_groups", 0)
        if self.version is not None and self.trajectories:
            staleness = sample_staleness(self.trajectories, self.version)
            stats["staleness_mean"] = sum(staleness) / len(staleness)
            stats["staleness_max"] = max(staleness)
        return stats


def summarize(outcomes: list[RolloutOutcome], elapsed_s: float) -> dict[str, Any]:
    """Counts by outcome, errors by type, reward mean/std, accuracy and token rate.

    `accuracy` is the fraction of scored rollouts that succeeded: their workflow's
    `success` (an environment's episodes) where given, else reward >= 1 (a correct answer
    under verifiable 0/1 rewards).
    """
    status = Counter(o.status for o in outcomes)
    scored = [o for o in outcomes if o.reward is not None]
    rewards = [o.reward for o in scored]
    tokens = sum(o.sampled_tokens for o in outcomes)
    # Over the span the outcomes were produced in: a batch taken from groups finished
    # ahead (asynchronous RL) is returned at once, but was not produced in no time.
    if outcomes and all(o.started for o in outcomes):
        elapsed_s = max(o.started + o.elapsed_s for o in outcomes) - min(
            o.started for o in outcomes
        )
    mean = sum(rewards) / len(rewards) if rewards else float("nan")
    var = sum((r - mean) ** 2 for r in rewards) / len(rewards) if rewards else float("nan")
    errors = Counter(o.error.split(":", 1)[0] for o in outcomes if o.error)
    export = Counter()
    for o in outcomes:
        export.update(o.export_stats)
    return {
        "rollouts": len(outcomes),
        "completed": status["completed"],
        "rejected": status["rejected"],
        "failed": status["failed"],
        "timed_out": status["timed_out"],
        "errors": dict(errors),
        "reward_mean": mean,
        "reward_std": math.sqrt(var) if rewards else float("nan"),
        "accuracy": (
            sum(o.reward >= 1.0 if o.success is None else o.success for o in scored) / len(scored)
            if scored
            else float("nan")
        ),
        "trajectories": sum(len(o.trajectories) for o in outcomes),
        "sampled_tokens": tokens,
        "rollout_tokens_per_s": tokens / elapsed_s if elapsed_s > 0 else 0.0,
        "elapsed_s": elapsed_s,
        "calls": export["calls"],
        "concat_breaks": export["concat_breaks"],
        "concat_broken_sessions": export["concat_broken_sessions"],
        "unrewarded_calls": export["unrewarded_calls"],
        "tool_call_errors": export["tool_call_errors"],
    }
