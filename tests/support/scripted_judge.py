"""An OpenAI-compatible chat endpoint that answers with scripted judgments, served on
loopback by looprl's own embedded uvicorn server, for the judge's tests: what a real
judge model would say cannot be scripted, its failures can.

`respond(prompt) -> str | int | float` gives a reply's text, an HTTP status to fail
with (int), or a delay in seconds before a default reply (float). Every request's
prompt is recorded in `requests`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from looprl.gateway import GatewayServer


class ScriptedJudge:
    def __init__(self, respond: Callable[[str], str | int | float]):
        self.respond = respond
        self.requests: list[str] = []
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self._chat)

    async def _chat(self, request: Request):
        body = await request.json()
        prompt = body["messages"][-1]["content"]
        self.requests.append(prompt)
        reply = self.respond(prompt)
        if isinstance(reply, int):
            return JSONResponse({"error": {"message": "scripted failure"}}, status_code=reply)
        if isinstance(reply, float):
            await asyncio.sleep(reply)
            reply = "Score: 5"
        return {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": reply},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    @asynccontextmanager
    async def serve(self) -> AsyncIterator[str]:
        """Serve on a free loopback port; yields the base URL (…/v1)."""
        async with GatewayServer(self.app, "127.0.0.1", 0) as server:
            yield f"{server.url}/v1"
