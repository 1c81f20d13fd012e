"""Errors in the shape of the API a route serves: `APIError` is answered as OpenAI does,
{"error": {"message", "type", "param", "code"}}, or on the Anthropic Messages routes
(`anthropic_route`) as Anthropic does, {"type": "error", "error": {"type", "message"}}
with the field named at the start of the message. A request that fails validation gets
a 400 naming the field (`messages[0].content[1]`) and what it got; an engine's refusal
of the request itself (EngineRequestError) a 400, its other errors 503s, and anything
unexpected a logged 500 that says where to look. `ClientGone` (the client left before
its answer) is answered 499, nginx's "client closed request", which nobody reads."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from looprl.engines.base import EngineError, EngineRequestError
from looprl.gateway.schemas import ITEM_TYPE_ERROR, ROLES

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type

    def body(self, anthropic: bool = False) -> dict[str, Any]:
        """The JSON answer: OpenAI's shape, or Anthropic's when `anthropic`."""
        if anthropic:
            kind = "request_too_large" if self.status == 413 else self.type
            kind = _ANTHROPIC_TYPES.get(kind, kind)
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": None}
        }

    def response(self, path: str) -> JSONResponse:
        """The answer to a request for `path`, in the shape of the API it serves."""
        return JSONResponse(self.body(anthropic_route(path)), status_code=self.status)


class ClientGone(Exception):
    """The client went away before its answer: the work for it was cancelled."""


# Anthropic's names for the error types that differ from OpenAI's.
_ANTHROPIC_TYPES = {"server_error": "api_error", "service_unavailable": "overloaded_error"}


def anthropic_route(path: str) -> bool:
    """Whether `path` is an Anthropic Messages API route (its errors take that shape)."""
    return path.endswith(("/v1/messages", "/v1/messages/count_tokens"))


def _param(loc: tuple) -> str:
    """`("body", "messages", 0, "content", "list[TextPart]", 1)` -> `messages[0].content[1]`.

    Pydantic names the union member it tried inside `loc` (`str`, `list[TextPart]`,
    `constrained-str`, a message's role, a `tagged` union's tag such as `item:message`);
    those are dropped.
    """
    out, after_index = "", False
    for part in loc[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif after_index and part in ROLES:  # the member of the messages' union by role
            pass
        elif part not in ("str", "int", "float", "bool") and part.isidentifier():
            out += f".{part}" if out else part
        after_index = isinstance(part, int)
    return out


def validation_error(errors: Sequence[Any]) -> APIError:
    """The 400 for a body that failed validation: pydantic's `errors()`, each `loc`
    starting with where the value came from ("body")."""
    err = max(errors, key=lambda e: len(e["loc"]))  # the deepest is the most specific
    if err["type"] == "json_invalid":
        detail = err.get("ctx", {}).get("error", "")
        return APIError(
            400, f"request body is not valid JSON: {detail} at character {err['loc'][-1]}"
        )
    param = _param(tuple(err["loc"]))
    if err["type"] in ("union_tag_invalid", "union_tag_not_found"):  # a message's role
        param += "." + err["ctx"]["discriminator"].strip("'")
    elif err["type"] == ITEM_TYPE_ERROR:  # an input item's or content block's type
        param += ".type"
    got = "" if err["type"] == "missing" else f" (got {json.dumps(err['input'], default=str)})"
    if len(got) > 200:
        got = got[:196] + "...)"
    if not param and err["type"] == "value_error":  # a check across fields of the request
        message = err["msg"].removeprefix("Value error, ")
        named = _FIELD_PATH.match(message)  # its message starts with the field it names
        return APIError(400, message, named.group(1) if named else None)
    if not param:
        return APIError(
            400,
            "the request body must be a JSON object sent with Content-Type: "
            f"application/json{got or ' (it is empty)'}",
        )
    return APIError(400, f"{param}: {err['msg'].removeprefix('Value error, ')}{got}", param)


_FIELD_PATH = re.compile(r"([A-Za-z_]\w*(?:\[\d+\]|\.[A-Za-z_]\w*)*): ")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors()).response(request.url.path)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.error(
            "The gateway failed on %s %s (a bug in looprl: please report it with this traceback)",
            request.method,
            request.url.path,
            exc_info=exc,
        )
        message = f"internal error ({type(exc).__name__}); the gateway's log has the traceback"
        return APIError(500, message, type="server_error").response(request.url.path)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        answer = APIError(exc.status_code, str(exc.detail), type=kind).response(request.url.path)
        answer.headers.update(exc.headers or {})
        return answer


def engine_failed(error: EngineError) -> APIError:
    """400 when the engine refused the request itself, else 503."""
    if isinstance(error, EngineRequestError):
        return APIError(400, f"the engine refused this request: {error}")
    message = f"the engine could not serve this request: {error}"
    return APIError(503, message, type="service_unavailable")
