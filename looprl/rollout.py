"""Running workflows against gateway sessions and collecting their trajectories.

Owns: one rollout (open a session, run the user's workflow with a timeout, score it,
export the session's calls as trajectories, close the session), groups of rollouts of
one dataset row, and two ways to drive them:

- `rollout_batch(rows)`: run every row x group_size now, with bounded concurrency
  (offline collection, evaluation, `looprl rollout`).
- `prepare_batch(rows, batch_size)`: continuous production under the staleness
  manager (staleness.py). A producer task keeps admitting groups while capacity
  allows; `prepare_batch` returns the next `batch_size` finished groups. With
  `max_head_offpolicyness = 0` this is synchronous RL.

A workflow that raises, hangs past `timeout_s`, returns None or a NaN reward never
stops the run: the rollout is counted by its outcome, and the first error of each type
is logged with its message. Knows nothing of training.

Concurrency contract: the producer task (started by the first `prepare_batch`)
consumes rows from the iterator given to it, waits for admission capacity (freed when
rollouts finish or the policy version advances, see `notify_version`), and puts each
finished group on a queue that `prepare_batch` reads. `close()` cancels it and every
rollout in flight. An exception inside the producer is re-raised by `prepare_batch`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from looprl.config import RolloutConfig
from looprl.staleness import StalenessManager
from looprl.trajectory import build_trajectories
from looprl.types import Interaction, Trajectory
from looprl.workflow import Workflow

log = logging.getLogger(__name__)

Status = Literal["completed", "rejected", "failed", "timed_out"]


class SessionHandle(Protocol):
    id: str
    base_url: str
    api_key: str


class RecordedSession(Protocol):
    interactions: list[Interaction]
    reward: float | dict[str, float] | None


class SessionHost(Protocol):
    """Where rollouts get their OpenAI endpoint: the gateway."""

    def open_session(self, sampling_overrides: dict[str, Any] | None = None) -> SessionHandle: ...

    def close_session(self, session_id: str) -> RecordedSession: ...


@dataclass
class RolloutOutcome:
    """What became of one rollout."""

    group_id: str
    status: Status
    trajectories: list[Trajectory] = field(default_factory=list)
    reward: float | None = None
    error: str | None = None
    elapsed_s: float = 0.0
    sampled_tokens: int = 0
    export_stats: dict[str, int] = field(default_factory=dict)


@dataclass
class RolloutResult:
    """The outcomes of a set of rollouts and their summary."""

    outcomes: list[RolloutOutcome]
    elapsed_s: float

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for o in self.outcomes for t in o.trajectories]

    def stats(self) -> dict[str, Any]:
        return summarize(self.outcomes, self.elapsed_s)


def summarize(outcomes: list[RolloutOutcome], elapsed_s: float) -> dict[str, Any]:
    """Counts by outcome, errors by type, reward mean/std, accuracy and token rate.

    `accuracy` is the fraction of scored rollouts whose reward is >= 1 (a correct
    answer under verifiable 0/1 rewards).
    """
    status = Counter(o.status for o in outcomes)
    rewards = [o.reward for o in outcomes if o.reward is not None]
    tokens = sum(o.sampled_tokens for o in outcomes)
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
        "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards) if rewards else float("nan"),
        "trajectories": sum(len(o.trajectories) for o in outcomes),
        "sampled_tokens": tokens,
        "rollout_tokens_per_s": tokens / elapsed_s if elapsed_s > 0 else 0.0,
        "elapsed_s": elapsed_s,
        "concat_breaks": export["concat_breaks"],
        "unrewarded_calls": export["unrewarded_calls"],
    }


class RolloutController:
    def __init__(
        self,
        host: SessionHost,
        workflow: Workflow,
        cfg: RolloutConfig,
        *,
        model_name: str,
        version: Callable[[], int] = lambda: 0,
        decode: Callable[[list[int]], str] | None = None,
        sampling_overrides: dict[str, Any] | None = None,
    ):
        self.host = host
        self.sampling_overrides = dict(sampling_overrides or {})
        self.workflow = workflow
        self.cfg = cfg
        self.model_name = model_name
        self.version = version
        self.decode = decode
        self.staleness = StalenessManager(
            batch_size=cfg.batch_size * cfg.group_size,
            max_concurrent_rollouts=cfg.max_concurrent_rollouts,
            max_head_offpolicyness=cfg.max_head_offpolicyness,
        )
        self._errors_logged: set[str] = set()
        self._producer: asyncio.Task | None = None
        self._ready: asyncio.Queue[list[RolloutOutcome]] = asyncio.Queue()
        self._changed = asyncio.Event()

    # ---- one rollout -------------------------------------------------------------

    async def run_one(
        self, row: dict, group_id: str, sampling_overrides: dict[str, Any] | None = None
    ) -> RolloutOutcome:
        handle = self.host.open_session({**self.sampling_overrides, **(sampling_overrides or {})})
        start = time.monotonic()
        status: Status = "completed"
        result: Any = None
        error = None
        try:
            result = await asyncio.wait_for(
                self.workflow.run(
                    row, base_url=handle.base_url, api_key=handle.api_key, model=self.model_name
                ),
                timeout=self.cfg.timeout_s,
            )
        except TimeoutError:
            status, error = "timed_out", f"TimeoutError: no result after {self.cfg.timeout_s} s"
        except Exception as e:  # user code: count it, never stop the run
            status, error = "failed", f"{type(e).__name__}: {e}"
        finally:
            session = self.host.close_session(handle.id)
        elapsed = time.monotonic() - start
        if status != "completed":
            self._log_error(error)
            return RolloutOutcome(group_id, status, error=error, elapsed_s=elapsed)

        reward, error = check_reward(result if result is not None else session.reward)
        if error:
            self._log_error(error)
            return RolloutOutcome(group_id, "failed", error=error, elapsed_s=elapsed)
        if reward is None:
            return RolloutOutcome(group_id, "rejected", elapsed_s=elapsed)
        trajectories, export_stats = build_trajectories(
            session.interactions,
            reward,
            self.cfg.trajectory_mode,
            group_id=group_id,
            session_id=handle.id,
            decode=self.decode,
        )
        if not trajectories:
            error = (
                "NoTrajectory: the workflow made no model call through its base_url "
                f"(calls recorded: {len(session.interactions)})"
            )
            self._log_error(error)
            return RolloutOutcome(group_id, "failed", error=error, elapsed_s=elapsed)
        scalar = reward if isinstance(reward, float) else sum(reward.values()) / len(reward)
        return RolloutOutcome(
            group_id,
            "completed",
            trajectories=trajectories,
            reward=scalar,
            elapsed_s=elapsed,
            sampled_tokens=sum(t.num_sampled_tokens for t in trajectories),
            export_stats=export_stats,
        )

    def _log_error(self, error: str) -> None:
        kind = error.split(":", 1)[0]
        if kind not in self._errors_logged:
            self._errors_logged.add(kind)
            log.warning("A rollout ended with %s (later %s errors are only counted)", error, kind)

    async def run_group(
        self, row: dict, group_size: int, sampling_overrides: dict[str, Any] | None = None
    ) -> list[RolloutOutcome]:
        group_id = uuid.uuid4().hex[:12]
        return list(
            await asyncio.gather(
                *(self.run_one(row, group_id, sampling_overrides) for _ in range(group_size))
            )
        )

    # ---- all at once -------------------------------------------------------------

    async def rollout_batch(
        self,
        rows: list[dict],
        *,
        group_size: int | None = None,
        sampling_overrides: dict[str, Any] | None = None,
        on_done: Callable[[RolloutOutcome], None] | None = None,
    ) -> RolloutResult:
        """Run every row `group_size` times now, at most `max_concurrent_rollouts` at once."""
        group_size = group_size or self.cfg.group_size
        limit = asyncio.Semaphore(self.cfg.max_concurrent_rollouts)
        start = time.monotonic()

        async def one(row: dict, group_id: str) -> RolloutOutcome:
            async with limit:
                outcome = await self.run_one(row, group_id, sampling_overrides)
            if on_done:
                on_done(outcome)
            return outcome

        jobs = []
        for row in rows:
            group_id = uuid.uuid4().hex[:12]
            jobs += [one(row, group_id) for _ in range(group_size)]
        outcomes = list(await asyncio.gather(*jobs))
        return RolloutResult(outcomes, time.monotonic() - start)

    # ---- continuous, under the staleness manager ---------------------------------

    async def prepare_batch(
        self, rows: Iterator[dict], batch_size: int | None = None
    ) -> RolloutResult:
        """Return the next `batch_size` finished groups (each with >= 1 trajectory)."""
        batch_size = batch_size or self.cfg.batch_size
        if self._producer is None:
            self._producer = asyncio.create_task(self._produce(rows), name="rollout-producer")
        start = time.monotonic()
        groups: list[list[RolloutOutcome]] = []
        while len(groups) < batch_size:
            getter = asyncio.ensure_future(self._ready.get())
            await asyncio.wait({getter, self._producer}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                self._producer.result()  # re-raise the producer's exception
                raise RuntimeError("the dataset ran out before the batch was full")
            groups.append(getter.result())
        return RolloutResult([o for g in groups for o in g], time.monotonic() - start)

    def notify_version(self) -> None:
        """Call after the policy version advanced: admission capacity may have grown."""
        self._changed.set()

    async def _produce(self, rows: Iterator[dict]) -> None:
        group_size = self.cfg.group_size
        in_flight: set[asyncio.Task] = set()
        try:
            for row in rows:
                while self.staleness.capacity(self.version()) < group_size:
                    self._changed.clear()
                    await self._changed.wait()
                    _raise_first_failure(in_flight)
                for _ in range(group_size):
                    self.staleness.on_start()
                task = asyncio.create_task(self._group_task(row, group_size))
                in_flight.add(task)
                task.add_done_callback(lambda t: self._on_group_done(t, in_flight))
            await asyncio.gather(*in_flight)
        finally:
            for task in in_flight:
                task.cancel()

    def _on_group_done(self, task: asyncio.Task, in_flight: set[asyncio.Task]) -> None:
        """Forget finished groups; keep a failed one so the producer re-raises its error."""
        if task.cancelled() or task.exception() is None:
            in_flight.discard(task)
        self._changed.set()

    async def _group_task(self, row: dict, group_size: int) -> None:
        outcomes = await self.run_group(row, group_size)
        for o in outcomes:
            if o.trajectories:
                self.staleness.on_accept()
            else:
                self.staleness.on_reject()
        self._changed.set()
        if any(o.trajectories for o in outcomes):
            await self._ready.put(outcomes)

    async def close(self) -> None:
        if self._producer is not None:
            self._producer.cancel()
            await asyncio.gather(self._producer, return_exceptions=True)
            self._producer = None


def _raise_first_failure(tasks: set[asyncio.Task]) -> None:
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception():
            raise task.exception()


def check_reward(value: Any) -> tuple[float | dict[str, float] | None, str | None]:
    """Validate a workflow's result: (reward, None) or (None, error message)."""
    if value is None:
        return None, None
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
