"""The failure budget: when a workflow's failures stop the run, and what it then says.

A rollout fails when the user's workflow raises, returns a reward training cannot use,
makes no model call, or runs past `rollout.timeout_s`. One failure never stops a run
(the controller counts it and goes on); a workflow that fails most of the time would
otherwise be retried forever, since a batch fills only with rollouts that produced data.
So: the run stops when more than `max_failure_share` of the last `window` rollouts
failed,

    failed(last window rollouts) > max_failure_share * window

(`window` defaults to a step's rollouts, at least two groups), with `WorkflowFailed`,
whose message holds the counts by error type and the workflow's own traceback of the
most common error. Rejected rollouts (the workflow returned None) are the workflow's
choice, not failures. `activity(since)` tells the hang watchdog what finished since its
last beat: a driver busy with failing rollouts is not hung.

Owns the window and the tracebacks; knows nothing of sessions or training.
"""

from __future__ import annotations

import re
import time
from collections import Counter, deque
from dataclasses import dataclass

RECENT = 10_000  # outcomes remembered for `activity`
FAILED = ("failed", "timed_out")
_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>.+)$', re.M)


class WorkflowFailed(Exception):
    """The workflow failed more rollouts than the failure budget allows."""


@dataclass(frozen=True)
class _Finished:
    at: float  # time.monotonic()
    status: str
    kind: str | None  # the error's type name ("KeyError"), None without an error


def error_kind(error: str) -> str:
    """'KeyError' of "KeyError: 'missing_key'"."""
    return error.split(":", 1)[0]


def where(traceback: str | None) -> str | None:
    """'agent.py:12 in run': the innermost frame of a formatted traceback, or None."""
    frames = list(_FRAME.finditer(traceback or ""))
    if not frames:
        return None
    last = frames[-1]
    return f"{last['file']}:{last['line']} in {last['name']}"


class FailureBudget:
    def __init__(self, max_failure_share: float, window: int):
        self.max_failure_share, self.window = max_failure_share, window
        self._last: deque[_Finished] = deque(maxlen=window)
        self._recent: deque[_Finished] = deque(maxlen=RECENT)
        self.tracebacks: dict[str, str] = {}  # the first of each error type
        self.errors: dict[str, str] = {}  # the first message of each error type

    def record(self, status: str, error: str | None, traceback: str | None = None) -> None:
        """One finished rollout: its status and, when it failed, its error and traceback."""
        kind = error_kind(error) if error else None
        if kind is not None:
            self.errors.setdefault(kind, error)
            if traceback:
                self.tracebacks.setdefault(kind, traceback)
        finished = _Finished(time.monotonic(), status, kind)
        self._last.append(finished)
        self._recent.append(finished)

    def exceeded(self) -> bool:
        failed = sum(f.status in FAILED for f in self._last)
        return self.max_failure_share < 1 and failed > self.max_failure_share * self.window

    def check(self) -> None:
        """Raise WorkflowFailed when the budget is spent."""
        if self.exceeded():
            raise WorkflowFailed(self.explain())

    def explain(self) -> str:
        failed = [f for f in self._last if f.status in FAILED]
        kinds = Counter(f.kind or f.status for f in failed)
        top = kinds.most_common(1)[0][0]
        counts = ", ".join(f"{kind} x{n}" for kind, n in kinds.most_common())
        lines = [
            f"The workflow failed {len(failed)} of the last {len(self._last)} rollouts, more "
            f"than rollout.max_failure_share={self.max_failure_share:g} of "
            f"rollout.failure_window={self.window}: {counts}.",
        ]
        if top in self.tracebacks:
            lines += [f"Its own traceback ({top}, the first one):", self.tracebacks[top].rstrip()]
        elif top in self.errors:
            lines.append(f"The first {top}: {self.errors[top]}")
        lines.append(
            "Fix the workflow (`looprl debug workflow` runs it and shows each call), or raise "
            "rollout.max_failure_share (1 never stops) to let the run go on through failures."
        )
        return "\n".join(lines)

    def activity(self, since: float) -> str | None:
        """What finished since `since` (time.monotonic()): 'N rollouts finished, M failed
        (KeyError x M)', or None when none did."""
        finished = [f for f in self._recent if f.at >= since]
        if not finished:
            return None
        failed = Counter(f.kind or f.status for f in finished if f.status in FAILED)
        text = f"{len(finished)} rollout(s) finished in that time"
        if failed:
            counts = ", ".join(f"{kind} x{n}" for kind, n in failed.most_common())
            text += f", {sum(failed.values())} of them failed ({counts})"
        return text
