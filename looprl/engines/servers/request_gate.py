"""Admission of requests to a remote engine server around a weight reload.

Owns the one rule that makes the per-token versions of a remote engine exact: the
policy version never changes while a request of ours is in flight. `close()` stops new
requests at the gate and returns once every admitted one has finished (drained), so
the weights can be reloaded with nothing of ours generating; `open()` lets the waiting
requests through. Each admitted request reads the version once, on entry, and every
token it gets back carries it.

Concurrency contract: `request()` (an async context manager, on the event loop) waits
while the gate is closed, then counts the request in flight until it exits, however it
exits (result, error, cancellation). `close()` waits for the count to reach 0; what
unblocks it is the last in-flight request leaving. Nothing here runs in the background.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class RequestGate:
    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_flight = 0

    @asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        while not self._open.is_set():  # woken by open(), the gate may have closed again
            await self._open.wait()
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def close(self) -> None:
        """Admit no new request; return once those in flight have finished."""
        self._open.clear()
        await self._idle.wait()

    def open(self) -> None:
        self._open.set()
