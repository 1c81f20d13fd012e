"""ASGI middleware that vLLM servers started by looprl load (`--middleware
looprl_server_auth.RequireKey`): every path but /health needs `Authorization: Bearer
<LOOPRL_SERVER_API_KEY>`.

vLLM's own `--api-key` guards only /v1 and a few other prefixes, which leaves the
development endpoints weight reloads need (/collective_rpc, /pause, /resume,
/reset_prefix_cache, /sleep, /wake_up) open to anyone who reaches the port. This file
runs inside the server's own venv, so it imports nothing of looprl's; its folder holds
nothing else, since it goes on the server's PYTHONPATH.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets

OPEN_PATHS = ("/health",)  # what looprl's start-up check polls before it has a client


class RequireKey:
    def __init__(self, app) -> None:
        key = os.environ.get("LOOPRL_SERVER_API_KEY", "")
        if not key:
            raise RuntimeError("LOOPRL_SERVER_API_KEY is not set: refusing to serve unguarded")
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        scheme, _, key = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        given = hashlib.sha256(key.strip().encode("latin-1")).digest()
        if scheme.lower() == "bearer" and secrets.compare_digest(given, self._digest):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized: this server needs looprl's key"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
