"""Running workflows against gateway sessions and collecting their trajectories.

Owns: one rollout (open a session, run the user's workflow with a timeout, score it,
export the session's calls as trajectories, close the session), groups of rollouts of
one dataset row, and two ways to drive them:

- `rollout_batch(rows, workflow=..., workflow_kwargs=..., group_size=...)`: run every
  row x group_size now, with bounded concurrency, outside the staleness manager
  (offline collection, evaluation, `looprl rollout`, debugging).
- `submit(row)` + `wait(count)`, and `prepare_batch(rows, batch_size)` on top of them:
  continuous production under the staleness manager (staleness.py). A dispatcher task
  admits queued groups (submitted first, then rows drawn from `prepare_batch`'s
  iterator) while capacity allows; `wait` returns the next finished groups. With
  `max_head_offpolicyness = 0` this is synchronous RL.

A workflow that raises, hangs past `timeout_s`, returns None or a NaN reward does not
stop the run by itself: the rollout is counted by its outcome, and the first error of
each type is logged with its message and where the workflow raised it. The failure
budget (failures.py) stops it when failures take more than
`rollout.max_failure_share` of the recent rollouts: `wait` (and `rollout_batch`, once
its rollouts are in) raises `WorkflowFailed` with the workflow's own traceback.
Groups are left out of a batch, counted and reported with the next batch, when none
of their rollouts produced data, when their rewards are all equal
(`dynamic_filtering`), or when their oldest token is more than `max_head_offpolicyness`
versions behind by the time they are taken (so nothing
trained is staler than the bound, even when a slow rollout finishes late). When
admission keeps a waiting caller from its groups for `blocked_warning_s`, the formula
with its numbers and the setting to raise are logged once. Knows nothing of training.

Concurrency contract: everything runs on one event loop. `submit` and `prepare_batch`
only queue work and start the dispatcher; the dispatcher waits on `_admission_changed`
(set when rollouts finish, callers wait, or `notify_version` says the policy version
advanced) and callers of `wait` on `_group_done`. `close()` cancels the dispatcher and
every rollout in flight. An exception inside the controller's own tasks (not a
workflow's, which is counted) is re-raised by the next `wait`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from looprl.config import RolloutConfig
from looprl.rollout.failures import FailureBudget, where
from looprl.rollout.outcome import (
    RolloutOutcome,
    RolloutResult,
    SessionHost,
    check_reward,
    run_in_session,
)
from looprl.rollout.staleness import StalenessManager
from looprl.rollout.trajectory import build_trajectories, call_records
from looprl.types import EpisodeReward
from looprl.workflows.protocol import Workflow, resolve_workflow

log = logging.getLogger(__name__)


@dataclass
class _Job:
    """A group waiting for admission: `group_size` rollouts of one row."""

    row: dict
    group_size: int
    workflow: Workflow
    sampling_overrides: dict[str, Any] | None = None
    index: int = 0  # admission order: batches list groups in it
    seeds: list[int] | None = None  # one sampling seed per rollout (rollout.seeded)
    position: int | None = None  # the data stream's position before this row was drawn


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
        seed: int = 0,
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
        self.failures = FailureBudget(cfg.max_failure_share, cfg.failure_window_rollouts())
        self._jobs: deque[_Job] = deque()  # submitted, not admitted yet
        self._rows: Iterator[dict] | None = None  # prepare_batch's data, after the jobs
        self._rows_done = False
        self._next_position = 0  # data position of the next row drawn from _rows
        self._admitting: _Job | None = None  # the job the dispatcher holds
        self._in_flight: dict[asyncio.Task, _Job] = {}
        self._failure: BaseException | None = None
        self._dispatcher: asyncio.Task | None = None
        self._ready: deque[tuple[_Job, list[RolloutOutcome]]] = deque()  # finished groups
        self._admission_changed = asyncio.Event()  # capacity, jobs or waiters changed
        self._group_done = asyncio.Event()  # a group finished, or the dispatcher stopped
        self._waiting: tuple[str, int, int] | None = None  # (who, groups asked, still needed)
        self._dropped: Counter[str] = Counter()
        self._left_out: list[RolloutOutcome] = []
        self._groups_admitted = 0
        self._rollouts_seeded = 0
        self._seed = seed
        self._warned: set[str] = set()  # admission terms a blocked warning named

    # ---- one rollout -------------------------------------------------------------

    async def run_one(
        self,
        row: dict,
        group_id: str,
        sampling_overrides: dict[str, Any] | None = None,
        workflow: Workflow | None = None,
    ) -> RolloutOutcome:
        """One rollout of `row` (its outcome counted by the failure budget: `_counted`)."""
        return self._counted(await self._run(row, group_id, sampling_overrides, workflow))

    def _counted(self, outcome: RolloutOutcome) -> RolloutOutcome:
        self.failures.record(outcome.status, outcome.error, outcome.traceback)
        return outcome

    async def _run(self, row, group_id, sampling_overrides, workflow) -> RolloutOutcome:
        workflow = workflow or self.workflow
        run, session, handle = await run_in_session(
            self.host,
            workflow,
            row,
            {**self.sampling_overrides, **(sampling_overrides or {})},
            model=self.model_name,
            timeout_s=self.cfg.timeout_s,
        )
        start, elapsed = run.started, run.elapsed_s
        if run.status != "completed":
            self._log_error(run.error, run.traceback)
            return RolloutOutcome(
                group_id, run.status, error=run.error, elapsed_s=elapsed, started=start,
                traceback=run.traceback,
            )  # fmt: skip

        # A reward the workflow returned, else one posted to the session.
        reward, error = check_reward(run.value if run.value is not None else session.reward)
        if error:
            self._log_error(error)
            return RolloutOutcome(group_id, "failed", error=error, elapsed_s=elapsed, started=start)
        if reward is None:
            return RolloutOutcome(group_id, "rejected", elapsed_s=elapsed, started=start)
        episode = reward if isinstance(reward, EpisodeReward) else None
        if episode is not None:  # per-call rewards for the samples, the total for the rollout
            reward = episode.per_call
        if episode is not None:
            scalar = episode.total
        else:
            scalar = reward if isinstance(reward, float) else sum(reward.values()) / len(reward)
        trajectories, export_stats, breaks = build_trajectories(
            session.interactions,
            reward,
            self.cfg.trajectory_mode,
            assignment=self.cfg.reward_assignment,
            discount=self.cfg.reward_discount,
            group_id=group_id,
            session_id=handle.id,
            decode=self.decode,
            episode_return=scalar,
            step_rewards=None if episode is None else episode.per_step,
        )
        export_stats["tool_call_errors"] = session.tool_call_errors
        if breaks and "concat_break" not in self._errors_logged:
            self._errors_logged.add("concat_break")
            log.warning(
                "A session's calls could not be concatenated into one sample, so it trains "
                "as %d samples: %s (later breaks are only counted as concat_breaks)",
                len(breaks) + 1,
                breaks[0],
            )
        if not trajectories:
            error = (
                "NoTrajectory: the workflow made no model call through its base_url "
                f"(calls recorded: {len(session.interactions)})"
            )
            self._log_error(error)
            return RolloutOutcome(group_id, "failed", error=error, elapsed_s=elapsed, started=start)
        return RolloutOutcome(
            group_id,
            "completed",
            trajectories=trajectories,
            reward=scalar,
            success=None if episode is None else episode.success,
            elapsed_s=elapsed,
            started=start,
            sampled_tokens=sum(t.num_sampled_tokens for t in trajectories),
            export_stats=export_stats,
            calls=call_records(
                session.interactions,
                reward,
                assignment=self.cfg.reward_assignment,
                discount=self.cfg.reward_discount,
            ),
            concat_breaks=breaks,
        )

    def _log_error(self, error: str, traceback: str | None = None) -> None:
        kind = error.split(":", 1)[0]
        if kind not in self._errors_logged:
            self._errors_logged.add(kind)
            at = f" at {found}" if (found := where(traceback)) else ""
            budget = f"rollout.max_failure_share={self.cfg.max_failure_share:g} of the last "
            log.warning(
                "A rollout ended with %s%s (later %s errors are only counted; the run stops "
                "when more than %s%d rollouts fail)", error, at, kind, budget, self.failures.window
            )  # fmt: skip

    async def run_group(
        self,
        row: dict,
        group_size: int,
        sampling_overrides: dict[str, Any] | None = None,
        workflow: Workflow | None = None,
        seeds: list[int] | None = None,
    ) -> list[RolloutOutcome]:
        group_id = uuid.uuid4().hex[:12]
        overrides = [dict(sampling_overrides or {}) for _ in range(group_size)]
        for i, seed in enumerate(seeds or []):
            overrides[i]["seed"] = seed
        outcomes = await asyncio.gather(
            *(self.run_one(row, group_id, overrides[i], workflow) for i in range(group_size))
        )
        for i, outcome in enumerate(outcomes):
            outcome.sample_index = i
        return list(outcomes)

    def _workflow_for(self, workflow: Any, workflow_kwargs: dict[str, Any] | None) -> Workflow:
        """The controller's workflow, or another one for this call (anything
        `resolve_workflow` takes: an instance, a class built with `workflow_kwargs`, an
        async function or "module:Name")."""
        if workflow is None:
            if workflow_kwargs:
                raise ValueError("workflow_kwargs were given without a workflow to build")
            return self.workflow
        return resolve_workflow(workflow, workflow_kwargs)

    # ---- all at once -------------------------------------------------------------

    async def rollout_batch(
        self,
        rows: list[dict],
        *,
        workflow: Any = None,
        workflow_kwargs: dict[str, Any] | None = None,
        group_size: int | None = None,
        sampling_overrides: dict[str, Any] | None = None,
        on_done: Callable[[RolloutOutcome], None] | None = None,
    ) -> RolloutResult:
        """Run every row `group_size` times now, at most `max_concurrent_rollouts` at once.

        Outside the staleness manager (offline collection, evaluation, debugging);
        `workflow` (instance, class, "module:Name" or async function, built with
        `workflow_kwargs`) replaces the controller's workflow for this call."""
        group_size = group_size or self.cfg.group_size
        chosen = self._workflow_for(workflow, workflow_kwargs)
        limit = asyncio.Semaphore(self.cfg.max_concurrent_rollouts)
        start = time.monotonic()

        async def one(row: dict, group_id: str) -> RolloutOutcome:
            async with limit:
                outcome = await self.run_one(row, group_id, sampling_overrides, chosen)
            if on_done:
                on_done(outcome)
            return outcome

        jobs = []
        for row in rows:
            group_id = uuid.uuid4().hex[:12]
            jobs += [one(row, group_id) for _ in range(group_size)]
        outcomes = list(await asyncio.gather(*jobs))
        self.failures.check()
        return RolloutResult(outcomes, time.monotonic() - start)

    # ---- continuous, under the staleness manager ---------------------------------

    def submit(
        self,
        row: dict,
        *,
        workflow: Any = None,
        workflow_kwargs: dict[str, Any] | None = None,
        group_size: int | None = None,
        sampling_overrides: dict[str, Any] | None = None,
    ) -> None:
        """Queue one group of `row` for admission; `wait` returns it when it finished."""
        group_size = group_size or self.cfg.group_size
        if group_size > self.cfg.max_concurrent_rollouts:
            raise ValueError(
                f"a group of {group_size} rollouts can never start under "
                f"rollout.max_concurrent_rollouts={self.cfg.max_concurrent_rollouts}"
            )
        workflow = self._workflow_for(workflow, workflow_kwargs)
        self._jobs.append(_Job(row, group_size, workflow, sampling_overrides))
        self._start_dispatcher()

    async def prepare_batch(
        self, rows: Iterable[dict], batch_size: int | None = None, *, first_position: int = 0
    ) -> RolloutResult:
        """Return the next `batch_size` finished groups, drawing groups from `rows`
        whenever nothing submitted is waiting. The first call's `rows` is kept: later
        calls go on where it stopped, so the engine stays busy between calls.
        `first_position` is the data position of the first row `rows` yields (a resumed
        run's); rows drawn after it count up from it (`earliest_untrained_position`)."""
        if self._rows is None and not self._rows_done:
            self._rows = iter(rows)
            self._next_position = first_position
        self._start_dispatcher()
        return await self.wait(batch_size or self.cfg.batch_size, who="prepare_batch")

    async def wait(
        self, count: int, timeout: float | None = None, *, who: str = "wait"
    ) -> RolloutResult:
        """The next `count` finished groups that are fresh enough to train on.

        A group whose oldest token is more than `max_head_offpolicyness` versions behind
        the current version is dropped (counted as `dropped_stale_groups`), as are groups
        with all-equal rewards under `dynamic_filtering`; waiting goes on for others.
        Raises TimeoutError after `timeout` seconds, RuntimeError when no group can come
        (the data ran out), and re-raises an error of the controller's own tasks."""
        deadline = None if timeout is None else time.monotonic() + timeout
        start = time.monotonic()
        groups: list[tuple[_Job, list[RolloutOutcome]]] = []
        try:
            while len(groups) < count:
                if self._ready:
                    job, group = self._ready.popleft()
                    if self._fresh(group):
                        groups.append((job, group))
                    continue
                self._check_dispatcher()
                if not (self._jobs or self._admitting or self._in_flight or self._rows):
                    raise RuntimeError(
                        f"{who}: {len(groups)} of {count} groups and no more can come: "
                        + (
                            "the dataset ran out"
                            if self._rows_done
                            else "nothing is submitted or running"
                        )
                    )
                self._waiting = (who, count, count - len(groups))
                self._admission_changed.set()  # the dispatcher's blocked-warning clock
                self._group_done.clear()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"{who}: {len(groups)} of {count} groups after {timeout} s; "
                        f"admission: {self.staleness.explain(self.version())}"
                    )
                await _wait_event(self._group_done, remaining)
        except BaseException:
            self._ready.extendleft(reversed(groups))  # nothing taken is lost
            raise
        finally:
            self._waiting = None
        dropped, self._dropped = self._dropped, Counter()
        left_out, self._left_out = self._left_out, []
        groups.sort(key=lambda g: g[0].index)  # admission order: the same batch however they finish
        return RolloutResult(
            [o for _, g in groups for o in g],
            time.monotonic() - start,
            dropped=dict(dropped),
            left_out=left_out,
            version=self.version(),
        )

    def notify_version(self) -> None:
        """Call after the policy version advanced: admission capacity may have grown."""
        self._admission_changed.set()

    def _fresh(self, group: list[RolloutOutcome]) -> bool:
        version = self.version()
        oldest = min(t.oldest_version() for o in group for t in o.trajectories)
        if self.staleness.is_fresh(oldest, version):
            return True
        for o in group:
            if o.trajectories:
                self.staleness.on_drop_accepted()
        self._dropped["dropped_stale_groups"] += 1
        self._left_out += group
        if "stale" not in self._errors_logged:
            self._errors_logged.add("stale")
            log.warning(
                "Dropped a group whose oldest token is from version %d, %d versions behind "
                "the trainer (rollout.max_head_offpolicyness=%d); later ones are counted as "
                "dropped_stale_groups",
                oldest,
                version - oldest,
                self.cfg.max_head_offpolicyness,
            )
        self._admission_changed.set()
        return False

    def _start_dispatcher(self) -> None:
        self._check_dispatcher()
        if self._dispatcher is None:
            self._dispatcher = asyncio.create_task(self._dispatch(), name="rollout-dispatcher")
            self._dispatcher.add_done_callback(lambda _: self._group_done.set())
        self._admission_changed.set()

    def _check_dispatcher(self) -> None:
        """Re-raise what stopped the dispatcher or one of its groups."""
        if self._failure is not None:
            raise self._failure
        if self._dispatcher is not None and self._dispatcher.done():
            self._dispatcher.result()

    def _next_job(self) -> _Job | None:
        if self._jobs:
            return self._jobs.popleft()
        if self._rows is not None:
            try:
                row = next(self._rows)
            except StopIteration:
                self._rows, self._rows_done = None, True
                self._group_done.set()
                return None
            position, self._next_position = self._next_position, self._next_position + 1
            return _Job(row, self.cfg.group_size, self.workflow, position=position)
        return None

    async def _dispatch(self) -> None:
        """Admit waiting groups in order, each once capacity allows all its rollouts."""
        while True:
            if self._failure is not None:
                return  # the run stops: wait() raises it; nothing more to start
            job = self._next_job()
            if job is None:
                self._admission_changed.clear()
                await self._admission_changed.wait()
                continue
            self._admitting = job
            await self._admit(job)
            self._admitting = None
            job.index, self._groups_admitted = self._groups_admitted, self._groups_admitted + 1
            if self.cfg.seeded:
                job.seeds = [self._next_seed() for _ in range(job.group_size)]
            for _ in range(job.group_size):
                self.staleness.on_start()
            task = asyncio.create_task(self._group_task(job))
            self._in_flight[task] = job
            task.add_done_callback(self._on_group_done)

    async def _admit(self, job: _Job) -> None:
        """Return when `job` may start; warn once when a waiting caller is blocked."""
        blocked_since = None
        while self.staleness.capacity(self.version()) < job.group_size:
            timeout = None
            # Blocked, as far as a caller can tell: it needs more groups than are running.
            # (Waiting for groups that run is waiting for rollouts, not for admission.)
            if self._waiting is None or self._waiting[2] <= len(self._in_flight):
                blocked_since = None
            else:
                blocked_since = blocked_since or time.monotonic()
                blocked = time.monotonic() - blocked_since
                if blocked < self.cfg.blocked_warning_s:
                    timeout = self.cfg.blocked_warning_s - blocked
                elif (limit := self._limiting_term(job)) not in self._warned:
                    self._warned.add(limit)  # once per term: the numbers are what matter
                    log.warning(self._blocked_message(job, blocked))
            self._admission_changed.clear()
            await _wait_event(self._admission_changed, timeout)

    def _limiting_term(self, job: _Job) -> str:
        _, staleness = self.staleness.terms(self.version())
        return "staleness" if staleness < job.group_size else "concurrency"

    def _blocked_message(self, job: _Job, blocked_s: float) -> str:
        who, asked, needed = self._waiting
        return self.staleness.blocked_message(
            self.version(),
            f"{who} for {blocked_s:.1f} s: it waits for {needed} more group(s) and "
            f"{len(self._in_flight)} are running; a group of {job.group_size} rollouts waits "
            f"to start ({len(self._jobs)} more queued).",
            who=who,
            asked=asked,
            starting=job.group_size,
            rows=self.cfg.batch_size,
            group_size=self.cfg.group_size,
        )

    def _on_group_done(self, task: asyncio.Task) -> None:
        self._in_flight.pop(task, None)
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()
        self._group_done.set()
        self._admission_changed.set()

    async def _group_task(self, job: _Job) -> None:
        outcomes = await self.run_group(
            job.row, job.group_size, job.sampling_overrides, job.workflow, job.seeds
        )
        row_id = str(job.row.get("id", "" if job.position is None else job.position))
        for o in outcomes:
            o.row_id = row_id
        rewards = [o.reward for o in outcomes if o.trajectories]
        keep = bool(rewards)
        if keep and self.cfg.dynamic_filtering and len(set(rewards)) == 1:
            keep = False
            self._dropped["filtered_groups"] += 1
        for o in outcomes:
            if keep and o.trajectories:
                self.staleness.on_accept()
            else:
                self.staleness.on_reject()
        if keep:
            self._ready.append((job, outcomes))
        else:
            self._left_out += outcomes
        self.failures.check()  # spent: wait() re-raises it (_on_group_done)

    def _next_seed(self) -> int:
        self._rollouts_seeded += 1
        return (self._seed * 1_000_003 + self._rollouts_seeded) % 2**62

    def earliest_untrained_position(self) -> int | None:
        """The data position of the first row drawn but not yet returned by `wait`: a
        resumed run starts drawing there (its rollouts in flight are not saved)."""
        jobs = [*self._jobs, self._admitting, *self._in_flight.values()]
        jobs += [job for job, _ in self._ready]
        positions = [j.position for j in jobs if j is not None and j.position is not None]
        return min(positions) if positions else None

    def state_dict(self) -> dict[str, Any]:
        untrained = sum(bool(o.trajectories) for _, group in self._ready for o in group)
        return {
            "staleness": self.staleness.state_dict(untrained),
            "groups_admitted": self._groups_admitted,
            "rollouts_seeded": self._rollouts_seeded,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.staleness.load_state_dict(state["staleness"])
        self._groups_admitted = state["groups_admitted"]
        self._rollouts_seeded = state["rollouts_seeded"]

    async def close(self) -> None:
        tasks = [t for t in (self._dispatcher, *self._in_flight) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._dispatcher = None
        self._in_flight.clear()


async def _wait_event(event: asyncio.Event, timeout: float | None) -> None:
    """Wait for `event` at most `timeout` seconds. Not `asyncio.wait_for`: on Python 3.11
    it swallows a cancellation that arrives as the event is set, and a cancelled
    dispatcher would then wait forever."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()
