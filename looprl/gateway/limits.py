"""Bounds on what one request may ask of the gateway, checked before any work is done.

Owns: the body-size, JSON-nesting and Unicode checks (an ASGI middleware that reads
the body once, answers 413 or 400 itself, and hands the body on), bounded JSON parsing
for strings inside a request (tool-call arguments) or a model's output, and the
per-request checks that need the app's limits (messages, stop strings, the token
budget). Does not own the field-by-field validation (schemas.py) or the error format
(errors.py).

Why a depth limit: Python's JSON parser and pydantic recurse once per level, so a body
nesting a few thousand levels deep raises RecursionError (a 500) instead of an answer.

Why the Unicode check is here, once for every route and field: JSON may escape half a
surrogate pair ("\\ud800"), and Python's parser takes it (and bytes that are not UTF-8)
as a string no encoder takes: the JSON answer that echoes it, the call's record, the
tokenizer. A body holding one anywhere, in a value or a key, is a 400 naming the field
before any route runs; so is a model's tool call holding one (`loads_bounded`), which is
then answered as plain text.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import torch
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from looprl.config import LimitsConfig
from looprl.gateway.errors import APIError, anthropic_route
from looprl.gateway.schemas import AssistantMessage, ChatMessage

_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_STEP = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")
# A \u escape of a surrogate, once escaped backslashes (\\) are out of the way.
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def nesting_depth(raw: bytes | str) -> int:
    """How deep JSON arrays and objects nest in `raw` (brackets inside strings ignored).

    Bytes operations in C and one cumulative sum: a 4 MiB body takes milliseconds on
    the event loop, however its brackets are laid out (a regex over its strings took
    0.36 s, a Python loop over `[]` repeated a second)."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if data.count(b"[") + data.count(b"{") <= 1:
        return data.count(b"[") + data.count(b"{")
    # Inside strings \\ and \" are escapes, read left to right as a JSON parser does;
    # without them, quotes split the rest into outside, string, outside, string, ...
    unescaped = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(unescaped.split(b'"')[::2])
    steps = bytearray(outside.translate(_DEPTH_STEP, _NOT_BRACKETS))  # 2 opens, 0 closes
    if not steps:
        return 0
    depths = (torch.frombuffer(steps, dtype=torch.uint8).to(torch.int32) - 1).cumsum(0)
    return max(int(depths.max()), 0)


def may_hold_lone_surrogate(body: bytes) -> bool:
    """Whether parsing `body` as JSON might give a string holding a lone surrogate: it
    has a \\u escape of a surrogate (paired or not), bytes that are not UTF-8 (Python's
    JSON parser decodes them with "surrogatepass"), or is UTF-16 or UTF-32. False for
    most bodies, in milliseconds."""
    if json.detect_encoding(body) != "utf-8":
        return True
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return b"\\u" in body and _ESCAPED_SURROGATE.search(body.replace(b"\\\\", b"")) is not None


def lone_surrogate(value: Any) -> APIError | None:
    """The 400 for the first string or key in parsed JSON `value` that holds a lone
    surrogate, naming its field; None if there is none. Such text is not Unicode: no
    encoder takes it (not a JSON answer, a record, a log file, nor the tokenizer).

    The field is named as validation errors name it (`input[1].content`); a key that
    is not a name ends the path at the object holding it."""
    stack: list[tuple[Any, str, bool]] = [(value, "", True)]  # (value, path, path is whole)
    while stack:  # as deep as the body (gateway.limits.max_json_depth)
        item, path, whole = stack.pop()
        if isinstance(item, str):
            if (at := _surrogate_at(item)) is not None:
                what = f"the text holds a lone surrogate ({item[at]!r} at character {at})"
                return _not_unicode(path, what)
        elif isinstance(item, list):
            for i in reversed(range(len(item))):
                stack.append((item[i], f"{path}[{i}]" if whole else path, whole))
        elif isinstance(item, dict):
            for key, v in reversed(item.items()):
                if _surrogate_at(key) is not None:
                    return _not_unicode(path, "a key holds a lone surrogate")
                named = whole and key.isidentifier()
                stack.append((v, (f"{path}.{key}" if path else key) if named else path, named))
    return None


def _lone_surrogate_in_body(body: bytes) -> APIError | None:
    """`lone_surrogate` of the parsed body; None for a body that is not JSON (the route
    says so)."""
    try:
        return lone_surrogate(json.loads(body))
    except ValueError:  # json.JSONDecodeError and UnicodeDecodeError are ones
        return None


def _surrogate_at(text: str) -> int | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _not_unicode(path: str, what: str) -> APIError:
    detail = f"{what}, which is not Unicode: send UTF-8 text"
    if not path:
        return APIError(400, f"the request body: {detail}")
    return APIError(400, f"{path}: {detail}", path)


def loads_bounded(text: str, max_depth: int) -> Any:
    """json.loads that refuses (ValueError) to nest deeper than `max_depth` instead of
    recursing until RecursionError; NaN and Infinity, which are not JSON (Python's
    parser takes them, and no answer holding one can be written); and strings holding a
    lone surrogate (an escaped \\ud800: no answer or tokenizer can encode it). Invalid
    JSON raises json.JSONDecodeError as usual."""
    if text.count("[") + text.count("{") > max_depth and nesting_depth(text) > max_depth:
        raise ValueError(f"the JSON nests deeper than {max_depth} levels")
    value = json.loads(text, parse_constant=_not_json)
    if "\\u" in text and (error := lone_surrogate(value)) is not None:
        raise ValueError(error.message)
    return value


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


class RequestLimits:
    """ASGI middleware: a request body over `max_request_bytes` is answered 413 (read no
    further), one nesting JSON deeper than `max_json_depth` or holding a lone surrogate
    400, before any route runs. A body that may hold a surrogate is parsed in a worker
    thread, so that a large one does not hold the event loop."""

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
        if may_hold_lone_surrogate(body):
            error = await asyncio.to_thread(_lone_surrogate_in_body, body)
            if error is not None:
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
