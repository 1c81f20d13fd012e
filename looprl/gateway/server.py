"""Running the gateway app over HTTP.

Owns: GatewayServer (uvicorn as a task inside the caller's event loop, so the
engine, the gateway and the rollout controller share one loop and one process),
opening sessions as SessionHandles agents can use, and serve_sessionless (one engine
on plain `/v1/...` routes, as `looprl serve` and the judge's own engine serve it).
Does not own the routes (app.py), what is served (`looprl serve` is
commands/serve.py) nor the engine's lifetime (its caller's).

Concurrency contract: `start` binds the socket itself (a busy port raises OSError
here instead of uvicorn exiting the process) and returns once uvicorn accepts
connections. The server task serves until `stop`, which lets in-flight requests
finish for up to `GRACEFUL_SHUTDOWN_S`, then re-raises anything the task died of.
Ctrl-C stays with the embedding program: uvicorn's signal handlers are not installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI
from transformers import PreTrainedTokenizerBase

from looprl.engines.base import Engine
from looprl.gateway.app import create_app
from looprl.gateway.sessions import Session, SessionStore
from looprl.types import SessionHandle

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 5
# How long an idle client connection stays open. uvicorn's default, 5 s, is as long as
# httpx (the openai client) keeps an idle connection for reuse, so an agent that reused
# one after ~5 s between turns could send its call as the gateway closed it and get an
# APIConnectionError. Longer than any client's idle expiry, the client always gives up
# the connection first.
KEEP_ALIVE_S = 75


class _EmbeddedServer(uvicorn.Server):
    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class GatewayServer:
    """A gateway app (from `create_app`) served on `host:port` (0 picks a free port)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        self.app = app
        self.host = host
        self.port = port
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def store(self) -> SessionStore:
        return self.app.state.store

    async def start(self) -> None:
        """Bind, start serving in the background, return once connections are accepted."""
        if self._task is not None:
            raise RuntimeError(f"GatewayServer on {self.url} is already started")
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise OSError(
                e.errno,
                f"gateway cannot bind {self.host}:{self.port}: {e.strerror}; "
                "choose another gateway.port (0 picks a free one)",
            ) from e
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            timeout_keep_alive=KEEP_ALIVE_S,
        )
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="gateway")
        while not self._server.started:
            if self._task.done():
                await self._task  # raises why it stopped
                raise RuntimeError(f"the gateway on {self.url} stopped while starting")
            await asyncio.sleep(0.005)
        log.debug("Gateway listening on %s", self.url)

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish (bounded), re-raise a crash."""
        if self._task is None:
            return
        self._server.should_exit = True
        task, self._task = self._task, None
        await task

    async def __aenter__(self) -> GatewayServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    def open_session(self, sampling_overrides: dict[str, Any] | None = None) -> SessionHandle:
        session = self.store.open(sampling_overrides)
        base_url = f"{self.url}/sessions/{session.id}/v1"
        return SessionHandle(session.id, base_url, session.api_key, session.reward_key)

    def close_session(self, session_id: str) -> Session:
        return self.store.close(session_id)


@contextlib.asynccontextmanager
async def serve_sessionless(
    engine: Engine,
    tokenizer: PreTrainedTokenizerBase,
    *,
    model_name: str,
    max_model_len: int,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
) -> AsyncIterator[GatewayServer]:
    """Serve `engine` on sessionless `/v1/...` routes at `host:port` (0 picks a free
    port); yields the running server (its `url`) and stops it on exit, letting requests
    in flight finish. With `api_key` every /v1 call needs `Authorization: Bearer
    <api_key>`. The engine is the caller's: it is not stopped here."""
    app = create_app(
        engine,
        tokenizer,
        model_name=model_name,
        store=SessionStore(),
        sessionless=True,
        max_model_len=max_model_len,
        sessionless_api_key=api_key,
    )
    async with GatewayServer(app, host, port) as server:
        yield server


def is_loopback(host: str) -> bool:
    """Whether `host` is this machine only (localhost, 127.0.0.0/8, ::1); a host name
    other than localhost may resolve to anything, so it is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
