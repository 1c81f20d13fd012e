"""How a training run stops: on a signal, within about one step's time, and on a
workflow that fails too often, each time with what was trained saved.

Owns `GracefulStop` (SIGTERM/SIGINT: the first lets the step in flight finish within a
grace, a second stops at once; a workflow blocking the event loop is interrupted where
it blocks), `finish_or_stop` (the loop's awaits of rollouts and evaluations, which
save and raise `Stopped` or `WorkflowFailed` when the run must stop) and the
exceptions. Does not own what a checkpoint holds (loop.py's `Saver`) nor when a
workflow has failed too often (rollout/failures.py).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Awaitable
from typing import Protocol, TypeVar

from looprl.rollout.failures import WorkflowFailed
from looprl.rollout.outcome import in_workflow, stop_workflows
from looprl.runs.paths import RunPaths

log = logging.getLogger(__name__)
T = TypeVar("T")
MIN_STOP_GRACE_S = 10.0  # after a signal, the work in progress gets at least this long


class Saving(Protocol):
    """What `finish_or_stop` needs of the loop's Saver."""

    last_step: int

    async def save(self, step: int) -> None: ...


class Stopped(Exception):
    """Training stopped on a signal: after saving a checkpoint at the end of `step`, or
    (`step` None) without one: at once on a second signal, or before any step was trained
    (`why` says when, and what blocked the run where it did)."""

    def __init__(self, signum: int, step: int | None, paths: RunPaths, mode: str, *, why=""):
        self.signum = signum
        name = signal.Signals(signum).name
        # recover.mode=off (make demo's) would set the checkpoint aside and start over.
        command = "the same command" if mode != "off" else "the same command with recover.mode=auto"
        if step is None and not why:
            message = (
                f"stopped at once by a second {name}, without a checkpoint; {command} "
                f"resumes from the last one in {paths.checkpoints}, if any"
            )
        elif step is None:
            message = f"stopped by {name} {why}; there is no checkpoint to resume from"
        else:
            message = (
                f"stopped by {name} after step {step}{' ' + why if why else ''}; the "
                f"checkpoint is in {paths.checkpoints} and {command} resumes from it"
            )
        super().__init__(message)


class StopRequested(Exception):
    """A signal came and the work in progress did not finish within the grace."""


class LoopBlocked(BaseException):
    """Raised by the signal handler inside a workflow that has blocked the event loop
    since before a signal came (`time.sleep` or a synchronous client inside `async
    def`). A BaseException: the `except Exception` around a workflow must not count it
    as the workflow's failure and go on; it reaches `finish_or_stop` as the rollout's
    error, and the run stops."""

    def __init__(self, where: str, blocked_s: float):
        super().__init__(where, blocked_s)
        self.where, self.blocked_s = where, blocked_s

    def why(self) -> str:
        return (
            f"while a workflow blocked the event loop for {self.blocked_s:.0f} s at "
            f"{self.where}: code that blocks inside `async def` (time.sleep, a synchronous "
            "HTTP client, a long computation) holds up every rollout; use `await "
            "asyncio.sleep`, an async client or `await asyncio.to_thread(...)`"
        )


class GracefulStop:
    """SIGTERM/SIGINT: finish the step, save, stop; always within about one step's time.

    The first signal lets the work in progress go on for at most `grace_s` (`within`):
    the step's rollouts, then its update; work past it is cancelled and what was trained
    is saved (a hanging workflow does not hold the run). A second signal stops at once:
    the training task is cancelled, and leaves this block as `Stopped` (no checkpoint).

    The handlers are Python's (`signal.signal`), not the event loop's, so that they run
    even while code on the loop blocks it: the main thread runs them between two
    bytecodes of whatever it runs, also inside `time.sleep`. A handler hands the signal
    to the loop. After a signal, a thread watches the loop's heartbeat: when it stopped
    for `BLOCKED_S`, the signal is delivered again, and the handler, finding a workflow's
    code running (`in_workflow`), raises `LoopBlocked` in it, after closing the loop to
    workflows not started yet (`stop_workflows`, lest the next one block it again). Our
    own slow work on the loop (writing a checkpoint) is never interrupted.
    """

    TICK_S = 0.5  # the loop's heartbeat
    BLOCKED_S = 5.0  # a loop without a heartbeat this long, after a signal, is blocked
    FIRST_GRACE_S = 30.0  # the grace before any step was timed

    def __init__(self, paths: RunPaths, mode: str) -> None:
        self.paths, self.mode = paths, mode  # recover.mode, for Stopped's message
        self.signal: int | None = None
        self.grace_s = self.FIRST_GRACE_S  # the loop sets it to its last step's time
        self._again = False
        self._received = 0  # signals handled
        self._redelivered = False  # a signal _watch sent is on its way
        self._exited = threading.Event()

    def __enter__(self) -> GracefulStop:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self.requested = asyncio.Event()
        self._beat()
        self._previous = {s: signal.signal(s, self._handler) for s in SIGNALS}
        return self

    def __exit__(self, kind, error, traceback) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._heartbeat.cancel()
        self._exited.set()
        if kind is LoopBlocked:  # not through finish_or_stop: nothing new to save
            why = error.why()
            raise Stopped(self.signal or signal.SIGTERM, None, self.paths, self.mode, why=why)
        if self._again and kind is asyncio.CancelledError:
            self._task.uncancel()  # our cancel, answered: the cleanup around goes on
            raise Stopped(self.signal, None, self.paths, self.mode) from None

    async def within(self, work: Awaitable[T]) -> T:
        """`work` awaited to its end, unless a signal came and `grace_s` more passed
        first: then it is cancelled and StopRequested raised."""
        task = asyncio.ensure_future(work)
        signalled = asyncio.ensure_future(self.requested.wait())
        try:
            await asyncio.wait({task, signalled}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                await asyncio.wait({task}, timeout=self.grace_s)
            if not task.done():
                log.warning(
                    "Stopping: what was running did not finish within %.0f s of the signal "
                    "(the last step's time); cancelling it",
                    self.grace_s,
                )
                raise StopRequested
            return task.result()
        finally:
            signalled.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _beat(self) -> None:
        self._alive = time.monotonic()
        self._heartbeat = self._loop.call_later(self.TICK_S, self._beat)

    def _handler(self, signum: int, frame) -> None:
        """Python's signal handler, on the main thread, inside whatever runs there."""
        blocked_s = time.monotonic() - self._alive
        if self._received and blocked_s > self.BLOCKED_S and in_workflow():
            stop_workflows(self._loop)
            code = frame.f_code
            raise LoopBlocked(f"{code.co_filename}:{frame.f_lineno} in {code.co_name}", blocked_s)
        if self._redelivered:  # our own, from _watch: not the user's second signal
            self._redelivered = False
            return
        if not self._received:
            threading.Thread(target=self._watch, args=(signum,), daemon=True).start()
        self._received += 1
        self._loop.call_soon_threadsafe(self._on_signal, signum)

    def _watch(self, signum: int) -> None:
        """After the first signal, until the block is left: deliver `signum` again each
        time the loop's heartbeat is BLOCKED_S old (the handler decides what is blocking)."""
        main = threading.main_thread().ident
        while not self._exited.wait(self.TICK_S):
            if time.monotonic() - self._alive > self.BLOCKED_S:
                self._redelivered = True
                signal.pthread_kill(main, signum)
                self._exited.wait(self.BLOCKED_S)

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.signal is None:
            self.signal = signum
            self.requested.set()
            log.warning(
                "Received %s: stopping after this step with a checkpoint (send it again to "
                "stop at once, without one)",
                name,
            )
        elif not self._again:
            self._again = True
            log.warning("Received %s again: stopping now", name)
            self._task.cancel()


SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def finish_or_stop(
    work: Awaitable[T], stop: GracefulStop, saver: Saving | None, trained: int
) -> T:
    """`work` (a step's rollouts, an evaluation) to its end, unless the run must stop
    first: a signal came and it did not finish within the grace, or the workflow spent
    its failure budget. Then the steps trained since the last checkpoint (up to
    `trained`) are saved, and Stopped (or WorkflowFailed) is raised."""
    try:
        return await stop.within(work)
    except (StopRequested, LoopBlocked, WorkflowFailed) as e:
        if isinstance(e, WorkflowFailed):
            log.error("Stopping the run: %s", e)
        if saver is not None and trained > saver.last_step:
            await saver.save(trained)
        if isinstance(e, WorkflowFailed):
            raise
        why = e.why() if isinstance(e, LoopBlocked) else ""
        if trained == 0:
            why = why or "before the first step was trained"
            raise Stopped(stop.signal, None, stop.paths, stop.mode, why=why) from None
        raise Stopped(stop.signal, trained, stop.paths, stop.mode, why=why) from None
