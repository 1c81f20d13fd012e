"""HTTP calls from an engine adapter to its inference server, with errors that say why.

Owns: one pooled `httpx.AsyncClient` per server, JSON in and out, and turning every
failure into EngineError naming the server, the URL and the cause: an error status
(with the server's own message; EngineRequestError for a 400 or 422, the request's own
fault), a body that is not JSON, and as EngineUnavailable
(the server serves nothing more) a refused or dropped connection (with the last lines
of the server's log when looprl launched it and it has exited) or a call after
`close`. Control calls (pause, reload, resume) are retried once on a dropped
connection: a server may close a kept-alive connection after an error response, and
those calls are idempotent. Generation calls are not retried.
"""

from __future__ import annotations

import os
from typing import Any

import httpx

from looprl.engines.base import EngineError, EngineRequestError, EngineUnavailable
from looprl.engines.servers.process import ServerProcess

# One call's bound; a generation is also bounded by rollout.timeout_s.
_TIMEOUT_S = 3600.0
# Concurrent generations hold one connection each; beyond this they wait for one.
_MAX_CONNECTIONS = 1024
ENGINE_KEY_VARIABLE = "LOOPRL_ENGINE_API_KEY"  # the key of a server attached by engine.url


class ServerClient:
    """Talks to the server at `url` (`name` is used in messages, e.g. "vLLM server").

    `process` is the server's process when looprl launched it, for its log in errors.
    Every call carries `Authorization: Bearer <api_key>`: the key looprl started the
    server with (`process.api_key`), or for a server attached by URL the one in
    LOOPRL_ENGINE_API_KEY, when set.
    """

    def __init__(
        self,
        url: str,
        *,
        name: str,
        process: ServerProcess | None = None,
        api_key: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.name = name
        self.process = process
        if api_key is None:
            api_key = process.api_key if process else os.environ.get(ENGINE_KEY_VARIABLE)
        self._has_key = bool(api_key)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=_MAX_CONNECTIONS, max_keepalive_connections=64)
        timeout = httpx.Timeout(_TIMEOUT_S, connect=10.0)
        self._client = httpx.AsyncClient(
            base_url=self.url, timeout=timeout, limits=limits, headers=headers
        )

    async def get(self, path: str) -> Any:
        return await self._call("GET", path, retry=True)

    async def post(
        self,
        path: str,
        body: dict | None = None,
        *,
        params: dict | None = None,
        retry: bool = False,
    ) -> Any:
        """POST `body` as JSON; returns the decoded reply (None for an empty one, the text
        of one that is not JSON by its content type)."""
        return await self._call("POST", path, body=body, params=params, retry=retry)

    async def close(self) -> None:
        await self._client.aclose()

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: dict | None = None,
        params: dict | None = None,
        retry: bool,
    ) -> Any:
        if self._client.is_closed:
            raise EngineUnavailable(
                f"the {self.name} at {self.url} was stopped (its engine's stop() closed the "
                f"connection) before {method} {path}"
            )
        attempts = 2 if retry else 1
        for attempt in range(attempts):
            try:
                response = await self._client.request(method, path, json=body, params=params)
                break
            except httpx.TransportError as e:
                if attempt + 1 < attempts:
                    continue
                raise EngineUnavailable(self._unreachable(path, e)) from e
        if response.status_code >= 400:
            # 400/422: the server refused what was asked (a prompt too long for it, ...),
            # which fails that request only; any other status is the server's own.
            error = EngineRequestError if response.status_code in (400, 422) else EngineError
            hint = ""
            if response.status_code == 401:
                hint = (
                    "; it refused the key looprl sent (LOOPRL_ENGINE_API_KEY for a server "
                    "attached by engine.url)"
                    if self._has_key
                    else f"; it needs an API key: set {ENGINE_KEY_VARIABLE} to the key it was "
                    "started with"
                )
            raise error(
                f"the {self.name} at {self.url} answered {method} {path} with "
                f"{response.status_code}: {_message(response)}{hint}"
            )
        if not response.content:
            return None
        if "json" not in response.headers.get("content-type", ""):
            return response.text  # e.g. vLLM's "Success: LoRA adapter ... added"
        try:
            return response.json()
        except ValueError as e:
            raise EngineError(
                f"the {self.name} at {self.url} answered {method} {path} with a body that is "
                f"not JSON: {response.text[:200]!r}"
            ) from e

    def _unreachable(self, path: str, error: Exception) -> str:
        message = (
            f"the {self.name} at {self.url} could not be reached for {path} "
            f"({type(error).__name__}: {error})"
        )
        if self.process is not None and not self.process.alive:
            message += (
                f"; it has exited. Last lines of its log {self.process.log_path}:\n"
                f"{self.process.log_tail()}"
            )
        elif self.process is None:
            message += "; check that it is running (engine.url)"
        return message


def _message(response: httpx.Response) -> str:
    """The server's own error message: OpenAI-style {"error": {"message"}} or the text."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if key in body:
                return str(body[key])
    return str(body)[:500]
