"""Bounds on what one request may ask of the gateway, checked before any work is done.

Owns: the body-size and JSON-nesting checks (an ASGI middleware that reads the body
once, answers 413 or 400 itself, and hands the body on), bounded JSON parsing for
strings inside a request (tool-call arguments) or a model's output, and the per-request
checks that need the app's limits (messages, stop strings, the token budget). Does not
own the field-by-field validation (schemas.py) or the error format (errors.py).

Why a depth limit: Python's JSON parser and pydantic recurse once per level, so a body
nesting a few thousand levels deep raises RecursionError (a 500) instead of an answer.
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from looprl.config import LimitsConfig
from looprl.gateway.errors import APIError, anthropic_route
from looprl.gateway.schemas import AssistantMessage, ChatMessage

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKET = re.compile(rb"[\[\]{}]")


def nesting_depth(raw: bytes | str) -> int:
    """How deep JSON arrays and objects nest in `raw` (brackets inside strings ignored)."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if data.count(b"[") + data.count(b"{") <= 1:
        return data.count(b"[") + data.count(b"{")
    depth = deepest = 0
    for match in _BRACKET.finditer(_STRING.sub(b"", data)):
        if match.group() in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def loads_bounded(text: str, max_depth: int) -> Any:
    """json.loads that refuses (ValueError) to nest deeper than `max_depth` instead of
    recursing until RecursionError, and NaN and Infinity, which are not JSON (Python's
    parser takes them, and no answer holding one can be written); invalid JSON raises
    json.JSONDecodeError as usual."""
    if text.count("[") + text.count("{") > max_depth and nesting_depth(text) > max_depth:
        raise ValueError(f"the JSON nests deeper than {max_depth} levels")
    return json.loads(text, parse_constant=_not_json)


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


class RequestLimits:
    """ASGI middleware: a request body over `max_request_bytes` is answered 413 (read no
    further), one nesting JSON deeper than `max_json_depth` 400, before any route runs."""

    def __init__(self, app: ASGIApp, max_request_bytes: int, max_json_depth: int) -> None:
        self.app = app
        self.max_bytes = max_request_bytes
        self.max_depth = max_json_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, send, self._too_large(f"{int(declared)} bytes"))
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: nothing to answer
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                error = self._too_large(f"more than {self.max_bytes} bytes")
                await self._refuse(scope, send, error)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if nesting_depth(body) > self.max_depth:
            error = APIError(
                400,
                f"the request body nests JSON deeper than {self.max_depth} levels "
                "(gateway.limits.max_json_depth)",
            )
            await self._refuse(scope, send, error)
            return

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the client to disconnect

        await self.app(scope, replay, send)

    def _too_large(self, size: str) -> APIError:
        return APIError(
            413,
            f"the request body is {size}; the gateway accepts at most {self.max_bytes} "
            "(gateway.limits.max_request_bytes)",
        )

    @staticmethod
    async def _refuse(scope: Scope, send: Send, error: APIError) -> None:
        body = json.dumps(error.body(anthropic_route(scope["path"]))).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def check_messages(messages: list[ChatMessage], limits: LimitsConfig) -> None:
    """At most `max_messages`; each tool call's arguments parse within the depth limit."""
    if len(messages) > limits.max_messages:
        raise APIError(
            400,
            f"messages: {len(messages)} messages; at most {limits.max_messages} per request "
            "(gateway.limits.max_messages)",
            "messages",
        )
    for i, message in enumerate(messages):
        if not isinstance(message, AssistantMessage):
            continue
        for j, call in enumerate(message.tool_calls or []):
            arguments = call.function.arguments
            if nesting_depth(arguments) > limits.max_json_depth:
                param = f"messages[{i}].tool_calls[{j}].function.arguments"
                raise APIError(
                    400,
                    f"{param}: the arguments nest JSON deeper than {limits.max_json_depth} "
                    "levels (gateway.limits.max_json_depth)",
                    param,
                )


def check_stop(stop: str | list[str] | None, limits: LimitsConfig) -> None:
    """At most `max_stop_strings` stop strings of at most `max_stop_chars` each."""
    strings = [stop] if isinstance(stop, str) else stop or []
    if len(strings) > limits.max_stop_strings:
        raise APIError(
            400,
            f"stop: {len(strings)} strings; at most {limits.max_stop_strings} "
            "(gateway.limits.max_stop_strings)",
            "stop",
        )
    for i, s in enumerate(strings):
        if len(s) > limits.max_stop_chars:
            param = "stop" if isinstance(stop, str) else f"stop[{i}]"
            raise APIError(
                400,
                f"{param}: {len(s)} characters; a stop string has at most "
                f"{limits.max_stop_chars} (gateway.limits.max_stop_chars)",
                param,
            )


def check_token_budget(n: int, max_new_tokens: int, limits: LimitsConfig) -> None:
    """n choices of up to max_new_tokens each stay within the per-request token budget."""
    if n * max_new_tokens > limits.request_token_budget:
        raise APIError(
            400,
            f"n={n} choices x max_tokens={max_new_tokens} = {n * max_new_tokens} tokens; one "
            f"request may ask for at most {limits.request_token_budget} "
            "(gateway.limits.request_token_budget): lower n or max_tokens",
            "max_tokens" if n == 1 else "n",
        )
