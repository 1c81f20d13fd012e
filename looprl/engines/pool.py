"""An engine pool: one Engine over several replica engines, each request served by one.

Owns: which replica serves a request, which replicas are healthy, restarting a replica
that died, sending a request again when its replica became unavailable, and fanning
weight updates, pause, resume and stop out to the replicas. Does not own the replicas
(any Engine: in-process LocalEngines, vLLM/SGLang adapters, adapters to engines in Ray
actors), how each batches, or how one starts again (its `restart()`).

Routing: a request goes to the healthy replica with the fewest outstanding tokens, the
sum over the requests it is serving of prompt tokens + max_new_tokens (ties: the one
that has served fewer, so an idle pool takes turns). A request with a `session` goes
where that session's first request went while that replica is healthy, so the
replica's prefix cache holds the earlier turns. The last MAX_STICKY_SESSIONS sessions
are remembered; one forgotten (least recently used first) is routed as a new one.

Failure: EngineUnavailable from a replica (stopped, died, unreachable) marks it
unhealthy: it gets no new request, the failed request is sent again from scratch to a
healthy replica (what it had generated is dropped, so a call still returns one
Generation), and its sessions move with their next request. Any other error (a bad
request: prompt too long, ...) reaches the caller and marks nothing.

Restarts: with `max_restarts` > 0 (engine.max_restarts), a replica marked unhealthy is
restarted at once, in the background, by its `restart()` (a new server process or
actor, serving the weights and version it served, or the trainer's newest with theirs),
each attempt bounded by RESTART_TIMEOUT_S, at most `max_restarts` times per replica
over the run. Once back it is paused if the pool is, and healthy again. While no
replica is healthy but one is restarting, requests wait for it instead of failing; with
none healthy and none restarting, every call raises EngineUnavailable naming each
replica and why it was marked. The log says what died and why, that it is being
restarted, and how long the restart took and which version it serves, or why it failed.

Weights: update_weights (or update_adapter), pause and resume go to every healthy
replica at once, and to a restarting one once it is back (so it comes back with the
newest weights); a replica failing with EngineUnavailable is marked (and restarted) and
the others go on. `version` is the lowest among healthy and restarting replicas. `stop`
cancels the restarts under way and stops every replica.

Concurrency contract: everything runs on the callers' event loop, and the bookkeeping
(counters, health, the session map) changes between awaits only, so it needs no lock.
The only background tasks are restarts, at most one per replica: each awaits its
replica's `restart()`, never raises (a failure is logged and kept as the replica's
unhealthy_reason, which calls then raise), and wakes the calls waiting for it by
finishing; `stop` cancels them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from looprl.engines.base import Engine, EngineUnavailable
from looprl.types import Generation, LoraAdapter, SamplingParams

log = logging.getLogger(__name__)

# Sessions whose replica is remembered; a session lives for one rollout, so this bounds
# the map at a few hundred KiB and drops only sessions long finished or idle.
MAX_STICKY_SESSIONS = 8192
# One restart attempt's bound: a vLLM server starts in ~30-100 s on CPU, a Ray actor
# also loads the model; beyond this the attempt counts as failed.
RESTART_TIMEOUT_S = 900.0


@runtime_checkable
class RestartableEngine(Engine, Protocol):
    async def restart(self) -> None:
        """Start again in place after dying (a new server process or actor), serving the
        weights and version it last served, or the trainer's newest with their version;
        not paused. Raises when it cannot."""
        ...


@dataclass(eq=False)
class _Replica:
    name: str
    engine: Engine
    outstanding_requests: int = 0
    outstanding_tokens: int = 0  # prompt + max_new_tokens of each outstanding request
    served: int = 0  # requests it answered
    unhealthy_reason: str | None = None  # why it was marked; None while healthy
    restarts: int = 0  # restart attempts begun
    restart: asyncio.Task | None = None  # the restart under way

    @property
    def healthy(self) -> bool:
        return self.unhealthy_reason is None


class EnginePool:
    """Serves the Engine protocol from `replicas`, named `names` in logs, errors and
    `stats()` (by default `LocalEngine[0]`, `VLLMEngine[1]`, ...). With `max_restarts`
    > 0 every replica must be a `RestartableEngine`."""

    def __init__(
        self,
        replicas: Sequence[Engine],
        names: Sequence[str] | None = None,
        *,
        max_restarts: int = 0,
    ) -> None:
        if not replicas:
            raise ValueError("EnginePool needs at least one replica engine, got none")
        if names is None:
            names = [f"{type(engine).__name__}[{i}]" for i, engine in enumerate(replicas)]
        if len(names) != len(replicas):
            raise ValueError(
                f"names has {len(names)} entries for {len(replicas)} replicas; give one "
                "name per replica"
            )
        repeated = [name for name, count in Counter(names).items() if count > 1]
        if repeated:
            raise ValueError(f"replica names must be unique; {repeated[0]!r} repeats")
        if max_restarts < 0:
            raise ValueError(f"max_restarts={max_restarts} must be >= 0")
        for name, engine in zip(names, replicas, strict=True):
            if max_restarts and not isinstance(engine, RestartableEngine):
                raise ValueError(
                    f"replica {name} ({type(engine).__name__}) has no restart(); give "
                    f"max_restarts=0 for a pool of such engines, not {max_restarts}"
                )
        self._replicas = [_Replica(n, e) for n, e in zip(names, replicas, strict=True)]
        self._sessions: OrderedDict[str, _Replica] = OrderedDict()  # least recent first
        self._retries = 0
        self._waiting = 0  # requests waiting for a restart (no replica is healthy)
        self._max_restarts = max_restarts
        self._paused = False  # pause() was called last, not resume(): restarted ones pause
        self._stopping = False  # stop() was called: nothing is restarted any more

    @property
    def engines(self) -> list[Engine]:
        """Every replica engine, in the order given."""
        return [r.engine for r in self._replicas]

    def healthy_engines(self) -> list[Engine]:
        """The replica engines not marked unavailable; EngineUnavailable if none is left."""
        healthy = [r.engine for r in self._replicas if r.healthy]
        if not healthy:
            raise EngineUnavailable(self._none_left())
        return healthy

    @property
    def version(self) -> int:
        """The lowest policy version among healthy replicas and those restarting."""
        return min(r.engine.version for r in self._serving())

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, session: str | None = None
    ) -> Generation:
        """Sample on one replica (see the module docstring for which); if it becomes
        unavailable, again from scratch on another, or on it once it has restarted."""
        tokens = len(prompt_ids) + sampling.max_new_tokens
        retry = False
        while True:
            replica = await self._route(session)
            if retry:
                self._retries += 1
            replica.outstanding_requests += 1
            replica.outstanding_tokens += tokens
            try:
                generation = await replica.engine.generate(prompt_ids, sampling, session=session)
            except EngineUnavailable as e:
                self._mark_unhealthy(replica, e)
                retry = True
                continue
            finally:
                replica.outstanding_requests -= 1
                replica.outstanding_tokens -= tokens
            replica.served += 1
            return generation

    async def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load `state_dict` as `version` in every healthy replica at once, and in a
        restarting one once it is back."""
        await self._fan_out(lambda engine: engine.update_weights(state_dict, version))

    async def update_adapter(self, adapter: LoraAdapter, version: int) -> None:
        """Apply `adapter` as `version` in every healthy replica, as `update_weights`."""
        await self._fan_out(lambda engine: engine.update_adapter(adapter, version))

    async def pause(self) -> None:
        self._paused = True
        await self._fan_out(lambda engine: engine.pause())

    async def resume(self) -> None:
        self._paused = False
        await self._fan_out(lambda engine: engine.resume())

    async def stop(self) -> None:
        """Cancel the restarts under way, then stop every replica at once; one already
        unavailable is not an error."""
        self._stopping = True
        restarts = [r.restart for r in self._replicas if r.restart is not None]
        for task in restarts:
            task.cancel()
        await asyncio.gather(*restarts, return_exceptions=True)
        results = await asyncio.gather(
            *(r.engine.stop() for r in self._replicas), return_exceptions=True
        )
        for replica, result in zip(self._replicas, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, EngineUnavailable):
                result.add_note(f"raised by engine replica {replica.name} while stopping")
                raise result

    def stats(self) -> dict[str, Any]:
        """Per replica (by name): healthy, outstanding_requests, outstanding_tokens,
        served and unhealthy_reason; retries, the requests sent again after their
        replica became unavailable; restarts, the restart attempts begun (all replicas);
        and restarting, the names of the replicas being restarted now."""
        replicas = {
            r.name: {
                "healthy": r.healthy,
                "outstanding_requests": r.outstanding_requests,
                "outstanding_tokens": r.outstanding_tokens,
                "served": r.served,
                "unhealthy_reason": r.unhealthy_reason,
            }
            for r in self._replicas
        }
        return {
            "replicas": replicas,
            "retries": self._retries,
            "restarts": sum(r.restarts for r in self._replicas),
            "restarting": [r.name for r in self._replicas if r.restart is not None],
        }

    async def _route(self, session: str | None) -> _Replica:
        """The session's replica while healthy, else the least loaded healthy one."""
        if session is not None:
            replica = self._sessions.get(session)
            if replica is not None and replica.healthy:
                self._sessions.move_to_end(session)
                return replica
        replica = min(await self._healthy(), key=lambda r: (r.outstanding_tokens, r.served))
        if session is not None:
            self._sessions[session] = replica
            self._sessions.move_to_end(session)
            if len(self._sessions) > MAX_STICKY_SESSIONS:
                self._sessions.popitem(last=False)
        return replica

    async def _healthy(self) -> list[_Replica]:
        """The healthy replicas; while none is but one is restarting, waits for its
        restart. Raises EngineUnavailable when none is healthy or restarting."""
        while True:
            healthy = [r for r in self._replicas if r.healthy]
            if healthy:
                return healthy
            restarts = [r.restart for r in self._replicas if r.restart is not None]
            if not restarts:
                raise EngineUnavailable(self._none_left())
            # asyncio.wait: a waiter cancelled (its rollout timed out) leaves the restart be.
            self._waiting += 1
            try:
                await asyncio.wait(restarts, return_when=asyncio.FIRST_COMPLETED)
            finally:
                self._waiting -= 1

    def _serving(self) -> list[_Replica]:
        """The replicas healthy or restarting; raises EngineUnavailable when none is."""
        serving = [r for r in self._replicas if r.healthy or r.restart is not None]
        if not serving:
            raise EngineUnavailable(self._none_left())
        return serving

    def _none_left(self) -> str:
        reasons = "; ".join(f"{r.name}: {r.unhealthy_reason}" for r in self._replicas)
        return (
            f"no engine replica can serve: all {len(self._replicas)} were marked "
            f"unavailable ({reasons}). Fix what stopped them and restart the run"
        )

    def _mark_unhealthy(self, replica: _Replica, error: EngineUnavailable) -> None:
        """Mark `replica` (once: its other requests fail alike) and start its restart
        when it has restarts left; else warn that it is gone for good."""
        if not replica.healthy:
            return
        replica.unhealthy_reason = str(error)
        if replica.restarts < self._max_restarts and not self._stopping:
            replica.restart = asyncio.create_task(
                self._restart(replica), name=f"restart engine replica {replica.name}"
            )
            return
        left = sum(r.healthy for r in self._replicas)
        used_up = ""
        if self._max_restarts:
            used_up = f" (its engine.max_restarts={self._max_restarts} restarts are used up)"
        moved = (
            f"its requests and sessions move to the other healthy replicas ({left} of "
            f"{len(self._replicas)} left)"
            if left
            else "no replica is left, so requests fail (the gateway answers 503, the "
            "rollouts count as failed) until the run is restarted"
        )
        log.warning(
            "Engine replica %s is unavailable%s; it gets no more requests, and %s: %s",
            replica.name,
            used_up,
            moved,
            error,
        )

    async def _restart(self, replica: _Replica) -> None:
        """Restart `replica` until it is back or its restarts are used up. Never raises
        (but for cancellation): what failed becomes its unhealthy_reason."""
        died = replica.unhealthy_reason
        try:
            while replica.restarts < self._max_restarts:
                replica.restarts += 1
                attempt = f"restart {replica.restarts} of engine.max_restarts={self._max_restarts}"
                others = sum(r.healthy for r in self._replicas)
                log.warning(
                    "Engine replica %s is down: %s. Restarting it (%s); %s",
                    replica.name,
                    died.rstrip("."),
                    attempt,
                    f"the other {others} healthy replica(s) take its requests meanwhile"
                    if others
                    else "requests wait for it, and those it was serving are sent again",
                )
                start = time.monotonic()
                try:
                    async with asyncio.timeout(RESTART_TIMEOUT_S):
                        await replica.engine.restart()
                        if self._paused:
                            await replica.engine.pause()
                except Exception as e:  # the next attempt, or the reason it stays down
                    took = time.monotonic() - start
                    why = str(e) or f"no answer within {RESTART_TIMEOUT_S:.0f} s"
                    replica.unhealthy_reason = f"{died}; {attempt} failed after {took:.0f} s: {why}"
                    log.error(
                        "Engine replica %s could not be restarted (%s, %.1f s): %s",
                        replica.name,
                        attempt,
                        took,
                        why,
                    )
                    continue
                replica.unhealthy_reason = None
                log.warning(
                    "Engine replica %s is back after a %.1f s restart (%s), serving policy "
                    "version %d; the %d request(s) waiting for it are sent again",
                    replica.name,
                    time.monotonic() - start,
                    attempt,
                    replica.engine.version,
                    self._waiting,
                )
                return
            log.error(
                "Engine replica %s stays down: its engine.max_restarts=%d restarts are used up. %s",
                replica.name,
                self._max_restarts,
                "The other replicas serve on"
                if any(r.healthy for r in self._replicas)
                else "No replica is left: requests fail until the run is restarted",
            )
        finally:
            replica.restart = None

    async def _fan_out(self, call: Callable[[Engine], Awaitable[None]]) -> None:
        """`call` on every healthy replica at once, and on a restarting one once it is
        back; marks those that are unavailable and raises another replica's error, or
        EngineUnavailable if none is left."""
        replicas = self._serving()
        results = await asyncio.gather(
            *(self._call_when_up(r, call) for r in replicas), return_exceptions=True
        )
        error = None
        for replica, result in zip(replicas, results, strict=True):
            if isinstance(result, BaseException) and error is None:
                result.add_note(f"raised by engine replica {replica.name}")
                error = result
        if error is not None:
            raise error
        self._serving()

    async def _call_when_up(self, replica: _Replica, call: Callable[[Engine], Awaitable[None]]):
        """`call` on `replica` once it is not restarting; unavailable, it is marked and
        called again after its restart. One that stays down is left out."""
        while True:
            if replica.restart is not None:
                await asyncio.wait([replica.restart])
            if not replica.healthy:
                return
            try:
                return await call(replica.engine)
            except EngineUnavailable as e:
                self._mark_unhealthy(replica, e)
