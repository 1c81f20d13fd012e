"""OpenAI-style errors: `APIError` is answered as {"error": {"message", "type", "param",
"code"}}; a request that fails validation gets a 400 naming the field (`messages[0]
.content[1]`) and what it got; an engine's refusal of the request itself
(EngineRequestError) a 400, its other errors 503s, and anything unexpected a logged 500
that says where to look."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from looprl.engines.base import EngineError, EngineRequestError
from looprl.gateway.schemas import ROLES

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

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": None}
        }


def _param(loc: tuple) -> str:
    """`("body", "messages", 0, "content", "list[TextPart]", 1)` -> `messages[0].content[1]`.

    Pydantic names the union member it tried inside `loc` (`str`, `list[TextPart]`,
    `constrained-str`, a message's role); those are dropped.
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


def _validation_error(exc: RequestValidationError) -> APIError:
    err = max(exc.errors(), key=lambda e: len(e["loc"]))  # the deepest is the most specific
    if err["type"] == "json_invalid":
        detail = err.get("ctx", {}).get("error", "")
        return APIError(
            400, f"request body is not valid JSON: {detail} at character {err['loc'][-1]}"
        )
    param = _param(tuple(err["loc"]))
    if err["type"] in ("union_tag_invalid", "union_tag_not_found"):  # a message's role
        param += "." + err["ctx"]["discriminator"].strip("'")
    got = "" if err["type"] == "missing" else f" (got {json.dumps(err['input'], default=str)})"
    if len(got) > 200:
        got = got[:196] + "...)"
    if not param and err["type"] == "value_error":  # a check across fields of the request
        return APIError(400, err["msg"].removeprefix("Value error, "))
    if not param:
        return APIError(
            400,
            "the request body must be a JSON object sent with Content-Type: "
            f"application/json{got or ' (it is empty)'}",
        )
    return APIError(400, f"{param}: {err['msg']}{got}", param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = _validation_error(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.error(
            "The gateway failed on %s %s (a bug in looprl: please report it with this traceback)",
            request.method,
            request.url.path,
            exc_info=exc,
        )
        message = f"internal error ({type(exc).__name__}); the gateway's log has the traceback"
        return JSONResponse(APIError(500, message, type="server_error").body(), status_code=500)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            APIError(exc.status_code, str(exc.detail), type=kind).body(),
            status_code=exc.status_code,
            headers=exc.headers,
        )


def engine_failed(error: EngineError) -> APIError:
    """400 when the engine refused the request itself, else 503."""
    if isinstance(error, EngineRequestError):
        return APIError(400, f"the engine refused this request: {error}")
    message = f"the engine could not serve this request: {error}"
    return APIError(503, message, type="service_unavailable")
