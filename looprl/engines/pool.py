"""An engine pool: one Engine over several replica engines, each request served by one.

Owns: which replica serves a request, which replicas are healthy, sending a request
again when its replica became unavailable, and fanning weight updates, pause, resume
and stop out to the replicas. Does not own the replicas (any Engine: in-process
LocalEngines, vLLM/SGLang adapters, adapters to engines in Ray actors) or how each
batches.

Routing: a request goes to the healthy replica with the fewest outstanding tokens, the
sum over the requests it is serving of prompt tokens + max_new_tokens (ties: the one
that has served fewer, so an idle pool takes turns). A request with a `session` goes
where that session's first request went while that replica is healthy, so the
replica's prefix cache holds the earlier turns. The last MAX_STICKY_SESSIONS sessions
are remembered; one forgotten (least recently used first) is routed as a new one.

Failure: EngineUnavailable from a replica (stopped, died, unreachable) marks it
unhealthy for good. One warning is logged, it gets no new request, the failed request
is sent again from scratch to another healthy replica, and its sessions move with
their next request. Any other error (a bad request: prompt too long, ...) reaches the
caller and marks nothing. With no healthy replica left, every call raises
EngineUnavailable naming each replica and why it was marked.

Weights: update_weights, pause and resume go to every healthy replica at once; a
replica failing with EngineUnavailable is marked and the others go on. `version` is the
lowest among healthy replicas. `stop` stops every replica, healthy or not.

Concurrency contract: everything runs on the callers' event loop, and the bookkeeping
(counters, health, the session map) changes between awaits only, so it needs no lock.
Nothing runs in the background.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from looprl.engines.base import Engine, EngineUnavailable
from looprl.types import Generation, SamplingParams

log = logging.getLogger(__name__)

# Sessions whose replica is remembered; a session lives for one rollout, so this bounds
# the map at a few hundred KiB and drops only sessions long finished or idle.
MAX_STICKY_SESSIONS = 8192


@dataclass(eq=False)
class _Replica:
    name: str
    engine: Engine
    outstanding_requests: int = 0
    outstanding_tokens: int = 0  # prompt + max_new_tokens of each outstanding request
    served: int = 0  # requests it answered
    unhealthy_reason: str | None = None  # why it was marked; None while healthy

    @property
    def healthy(self) -> bool:
        return self.unhealthy_reason is None


class EnginePool:
    """Serves the Engine protocol from `replicas`, named `names` in logs, errors and
    `stats()` (by default `LocalEngine[0]`, `VLLMEngine[1]`, ...)."""

    def __init__(self, replicas: Sequence[Engine], names: Sequence[str] | None = None) -> None:
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
        self._replicas = [_Replica(n, e) for n, e in zip(names, replicas, strict=True)]
        self._sessions: OrderedDict[str, _Replica] = OrderedDict()  # least recent first
        self._retries = 0

    @property
    def engines(self) -> list[Engine]:
        """Every replica engine, in the order given."""
        return [r.engine for r in self._replicas]

    def healthy_engines(self) -> list[Engine]:
        """The replica engines not marked unavailable; EngineUnavailable if none is left."""
        return [r.engine for r in self._healthy()]

    @property
    def version(self) -> int:
        """The lowest policy version among healthy replicas."""
        return min(r.engine.version for r in self._healthy())

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, session: str | None = None
    ) -> Generation:
        """Sample on one replica (see the module docstring for which); if it becomes
        unavailable, again from scratch on another."""
        tokens = len(prompt_ids) + sampling.max_new_tokens
        retry = False
        while True:
            replica = self._route(session)
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
        """Load `state_dict` as `version` in every healthy replica at once."""
        await self._fan_out(lambda engine: engine.update_weights(state_dict, version))

    async def pause(self) -> None:
        await self._fan_out(lambda engine: engine.pause())

    async def resume(self) -> None:
        await self._fan_out(lambda engine: engine.resume())

    async def stop(self) -> None:
        """Stop every replica at once; one already unavailable is not an error."""
        results = await asyncio.gather(
            *(r.engine.stop() for r in self._replicas), return_exceptions=True
        )
        for replica, result in zip(self._replicas, results, strict=True):
            if isinstance(result, BaseException) and not isinstance(result, EngineUnavailable):
                result.add_note(f"raised by engine replica {replica.name} while stopping")
                raise result

    def stats(self) -> dict[str, Any]:
        """Per replica (by name): healthy, outstanding_requests, outstanding_tokens,
        served and unhealthy_reason; and retries, the requests sent again after their
        replica became unavailable."""
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
        return {"replicas": replicas, "retries": self._retries}

    def _route(self, session: str | None) -> _Replica:
        """The session's replica while healthy, else the least loaded healthy one."""
        if session is not None:
            replica = self._sessions.get(session)
            if replica is not None and replica.healthy:
                self._sessions.move_to_end(session)
                return replica
        replica = min(self._healthy(), key=lambda r: (r.outstanding_tokens, r.served))
        if session is not None:
            self._sessions[session] = replica
            self._sessions.move_to_end(session)
            if len(self._sessions) > MAX_STICKY_SESSIONS:
                self._sessions.popitem(last=False)
        return replica

    def _healthy(self) -> list[_Replica]:
        """The healthy replicas; raises EngineUnavailable when there is none."""
        healthy = [r for r in self._replicas if r.healthy]
        if not healthy:
            reasons = "; ".join(f"{r.name}: {r.unhealthy_reason}" for r in self._replicas)
            raise EngineUnavailable(
                f"no engine replica can serve: all {len(self._replicas)} were marked "
                f"unavailable ({reasons}). Fix what stopped them and restart the run"
            )
        return healthy

    def _mark_unhealthy(self, replica: _Replica, error: EngineUnavailable) -> None:
        if not replica.healthy:
            return  # marked by another of its requests: warned once already
        replica.unhealthy_reason = str(error)
        left = sum(r.healthy for r in self._replicas)
        log.warning(
            "Engine replica %s is unavailable; it gets no more requests, and its requests "
            "and sessions move to the other healthy replicas (%d of %d left): %s",
            replica.name,
            left,
            len(self._replicas),
            error,
        )

    async def _fan_out(self, call: Callable[[Engine], Awaitable[None]]) -> None:
        """`call` on every healthy replica at once; marks those that are unavailable and
        raises another replica's error, or EngineUnavailable if none is left."""
        replicas = self._healthy()
        results = await asyncio.gather(*(call(r.engine) for r in replicas), return_exceptions=True)
        error = None
        for replica, result in zip(replicas, results, strict=True):
            if isinstance(result, EngineUnavailable):
                self._mark_unhealthy(replica, result)
            elif isinstance(result, BaseException) and error is None:
                result.add_note(f"raised by engine replica {replica.name}")
                error = result
        if error is not None:
            raise error
        self._healthy()
