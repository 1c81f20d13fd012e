"""The Responses API and the Anthropic Messages API, answered through the chat path.

Owns: what each of their routes does in order: its request as a chat request
(openai_responses.py, anthropic_messages.py say how), the Gateway's `plan` of it (the
prompt, sampling and tool parsing chat completions use), one generation, the answer in
the API's shape (whole, or as its stream of named events), and the record under the
API's own id; for the Responses API, the conversations `previous_response_id` continues.
Does not own routes or auth (app.py), nor the bodies (the two modules).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from looprl.engines.base import EngineError
from looprl.gateway import anthropic_messages, openai_responses, prompts
from looprl.gateway import limits as limits_lib
from looprl.gateway.anthropic_messages import CountTokensRequest, MessagesRequest
from looprl.gateway.errors import APIError, ClientGone, engine_failed, validation_error
from looprl.gateway.openai_responses import ResponsesRequest
from looprl.gateway.responses import Plan, chat_logprobs, named_sse
from looprl.gateway.schemas import ChatRequest
from looprl.gateway.sessions import Session
from looprl.types import Generation

if TYPE_CHECKING:
    from looprl.gateway.app import Gateway

# The chat fields each API names otherwise, for the chat path's errors (`_named_as`).
RESPONSES_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens"}
MESSAGES_FIELDS = {"stop": "stop_sequences"}


# ---- the Responses API -------------------------------------------------------------


async def responses(
    gateway: Gateway, request: Request, req: ResponsesRequest, session: Session | None
):
    stored = session.responses if session is not None else gateway.stored_responses
    history: list[dict] = []
    if req.previous_response_id is not None:
        if req.previous_response_id not in stored:
            where = "this session" if session is not None else "this server"
            raise APIError(
                400,
                f"previous_response_id: no response {req.previous_response_id!r} was "
                f"answered by {where}",
                "previous_response_id",
            )
        history = stored[req.previous_response_id]
    fields, conversation = req.chat_request(history)
    with _named_as(RESPONSES_FIELDS):
        plan = await gateway.plan(request, _as_chat(fields), session, f"resp_{uuid.uuid4().hex}")
    plan.call.object = "response"

    def body(gen: Generation, text: str, finish: str) -> dict:
        message, finish = plan.message(0, text, finish)
        lps = chat_logprobs(gateway.tokenizer, gen) if req.wants_logprobs() else None
        output = openai_responses.output_items(message, lps)
        stored[plan.call.id] = [*conversation, _as_sent_back(message)]
        while len(stored) > openai_responses.STORED_RESPONSES:
            del stored[next(iter(stored))]
        ids = plan.call.prompt_ids
        answer = openai_responses.response_body(
            plan.call.id, req, gateway.model_name, output, finish, len(ids), len(gen.output_ids)
        )
        return {**answer, "prompt_token_ids": ids, "output_token_ids": gen.output_ids}

    def error(e: APIError) -> list[dict]:
        return [openai_responses.error_event(e.body())]

    stream = openai_responses.stream_events if req.stream else None
    return await _respond_one(gateway, request, plan, session, body, stream, error)


# ---- the Anthropic Messages API ----------------------------------------------------


async def messages(
    gateway: Gateway, request: Request, req: MessagesRequest, session: Session | None
):
    with _named_as(MESSAGES_FIELDS):
        chat_req = _as_chat(req.chat_request())
        plan = await gateway.plan(request, chat_req, session, anthropic_messages.new_id())
    plan.call.object = "message"

    def body(gen: Generation, text: str, finish: str) -> dict:
        message, finish = plan.message(0, text, finish)
        stop = None
        if finish == "stop" and plan.sampling[0].stop:  # the stop string, if one ended it
            full = gateway.tokenizer.decode(gen.output_ids, skip_special_tokens=True)
            stop = _stop_hit(full, plan.sampling[0].stop)
        return anthropic_messages.message_body(
            plan.call.id,
            gateway.model_name,
            anthropic_messages.content_blocks(message),
            anthropic_messages.stop_reason(finish, stop),
            stop,
            len(plan.call.prompt_ids),
            len(gen.output_ids),
        )

    def error(e: APIError) -> list[dict]:
        return [e.body(anthropic=True)]

    stream = anthropic_messages.stream_events if req.stream else None
    return await _respond_one(gateway, request, plan, session, body, stream, error)


async def count_tokens(
    gateway: Gateway, request: Request, req: CountTokensRequest, session: Session | None
) -> dict:
    """The prompt's length in tokens, however long (no context limit: counting is the
    point), built in the prompt lanes as a call's prompt is."""
    with _named_as(MESSAGES_FIELDS):
        chat_req = _as_chat(req.chat_request())
        limits_lib.check_messages(chat_req.messages, gateway.limits)
        prompt_ids, _, _ = await gateway.prompt(
            request,
            session,
            lambda: prompts.request_prompt(
                gateway.tokenizer,
                chat_req,
                session,
                native_tools=gateway.native_tools,
                max_chars=None,
            ),
        )
    return {"input_tokens": len(prompt_ids)}


async def _respond_one(
    gateway: Gateway,
    request: Request,
    plan: Plan,
    session: Session | None,
    body: Callable[[Generation, str, str], dict],
    stream: Callable[[dict], list[dict]] | None,
    error: Callable[[APIError], list[dict]],
):
    """Answer a one-output request: `body(gen, text, finish)` whole, or streamed as
    the events `stream(body)` makes; an engine failure or the session closing
    mid-stream as `error(...)`. Either way the generation stops when the client goes
    away or the session closes (`Gateway.generate`)."""

    def answer(gen: Generation) -> dict:
        text, finish = gateway.finish(gen, plan.sampling[0])
        out = body(gen, text, finish)
        gateway.record(session, plan.call, [gen], [(text, finish)])
        return out

    if stream is not None:

        async def events() -> AsyncIterator[str]:
            try:
                gens = await gateway.generate(request, plan.call, plan.sampling, session)
            except ClientGone:
                return
            except (EngineError, APIError) as e:
                failure = engine_failed(e) if isinstance(e, EngineError) else e
                for event in error(failure):
                    yield named_sse(event)
                return
            for event in stream(answer(gens[0])):
                yield named_sse(event)

        return StreamingResponse(events(), media_type="text/event-stream")
    try:
        gens = await gateway.generate(request, plan.call, plan.sampling, session)
    except EngineError as e:
        raise engine_failed(e) from None
    return JSONResponse(answer(gens[0]))


def _as_chat(fields: dict[str, Any]) -> ChatRequest:
    """Another API's request as the chat request it becomes; a 400 naming the field
    where the conversion holds something chat completions refuse."""
    try:
        return ChatRequest.model_validate(fields)
    except ValidationError as e:
        error = validation_error([{**err, "loc": ("body", *err["loc"])} for err in e.errors()])
        error.message += _AS_CHAT
        raise error from None


@contextmanager
def _named_as(fields: dict[str, str]) -> Iterator[None]:
    """The chat path's 400s in the API's terms: the field (renamed by `fields`, chat
    name to the API's) starts the message, as Anthropic's errors do. A path into chat's
    `messages` names only the API's conversation field, whose items are not the chat
    messages one to one; the message says where in the chat messages."""
    try:
        yield
    except APIError as e:
        if e.param is None:
            raise
        root = re.split(r"[.\[]", e.param, maxsplit=1)[0]
        detail = e.message.removeprefix(f"{e.param}: ")
        if root == "messages" and e.param != root:
            where = f" (at {e.param} in the request as chat messages)"
            detail = detail.removesuffix(_AS_CHAT) + where
            e.param = fields.get(root, root)
        else:
            e.param = fields.get(root, root) + e.param[len(root) :]
        e.message = f"{e.param}: {detail}"
        raise


_AS_CHAT = " (in the request as chat messages)"


def _as_sent_back(message: dict) -> dict:
    """An answer's assistant message as a later request carries it (no empty content)."""
    if message.get("tool_calls") and not message.get("content"):
        return {**message, "content": None}
    return message


def _stop_hit(text: str, stops: list[str]) -> str | None:
    """The stop string that ended `text` (the earliest found), if one did."""
    hits = [(i, stop) for stop in stops if (i := text.find(stop)) >= 0]
    return min(hits)[1] if hits else None
