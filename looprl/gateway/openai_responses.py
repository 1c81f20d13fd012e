"""OpenAI's Responses API (`POST /v1/responses`) on top of the gateway's chat path.

Owns: the request body (input items, `instructions`, function tools, `tool_choice`,
`previous_response_id`, sampling fields), turning it into the chat request the gateway
already serves (so the prompt, the tool format, the sampled-id reuse and the recording
are the chat path's, and one conversation gives the same tokens over either API), and
the answers: the response object with its output items, and the stream of Responses
events built from it. Does not own HTTP or sampling (app.py).

What a request becomes:
- `instructions` is a system message before everything (not carried over by
  `previous_response_id`, as OpenAI documents);
- `input` as a string is one user message; message items keep their role (`developer`
  is `system`), their text parts joined with "\\n";
- `function_call` items join the assistant message before them (or start one) as its
  tool calls; `function_call_output` items are `role: tool` messages;
- `previous_response_id` puts that response's conversation (its input and its output)
  first; within a session only, or among the last `STORED_RESPONSES` answered by
  `looprl serve`.

Where it departs from OpenAI: one output per request (no `n`), streamed in one piece once
generated; `text.format`, `reasoning`, `truncation` and `store` are accepted and
ignored; non-function tools (web search, file search, ...) and input items other than
messages, function calls and their outputs are a 400 naming the item.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from looprl.gateway.schemas import JSONObject, StopString, tagged

STORED_RESPONSES = 1024  # conversations `looprl serve` keeps for previous_response_id
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class InputText(BaseModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(BaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputText]

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "\n".join(part.text for part in self.output)


InputItem = tagged(
    "message",
    message=MessageItem,
    function_call=FunctionCallItem,
    function_call_output=FunctionCallOutputItem,
)


class FunctionTool(BaseModel):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: JSONObject | None = None  # echoed in the answer: finite numbers only
    strict: bool | None = None


class NamedFunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class ResponsesRequest(BaseModel):
    model: str | None = None
    input: Annotated[str, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)  # vLLM's, as in chat completions
    seed: int | None = Field(None, ge=0, lt=2**63)  # looprl's, as in chat completions
    stop: StopString | list[StopString] | None = None  # vLLM's
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    stream: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None

    def chat_request(self, history: list[dict]) -> tuple[dict[str, Any], list[dict]]:
        """The chat request's fields, and the conversation a later
        `previous_response_id` continues (this request's messages without
        `instructions`; the caller adds the output)."""
        conversation = [*history, *self._messages()]
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        fields: dict[str, Any] = {
            "messages": system + conversation,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.tools:
            fields["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            named = {"name": self.tool_choice.name}
            fields["tool_choice"] = {"type": "function", "function": named}
        else:
            fields["tool_choice"] = self.tool_choice
        if self.wants_logprobs():
            fields["logprobs"] = True
            fields["top_logprobs"] = self.top_logprobs or 0
        return fields, conversation

    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or []) or bool(self.top_logprobs)

    def _messages(self) -> list[dict]:
        """The input as chat messages: function calls join the assistant message before them."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                if not (out and out[-1]["role"] == "assistant"):
                    out.append({"role": "assistant", "content": None})
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        return out


# ---- answers -----------------------------------------------------------------------


def output_items(message: dict, logprobs: list[dict] | None) -> list[dict]:
    """A chat choice's assistant message as Responses output items: its text (if any,
    or if there are no calls) as a message item, then one function_call per call."""
    items = []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        part = {
            "type": "output_text",
            "text": message.get("content") or "",
            "annotations": [],
            "logprobs": logprobs or [],
        }
        items.append(
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": "completed",
                "role": "assistant",
                "content": [part],
            }
        )
    for call in calls:
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    return items


def response_body(
    response_id: str,
    req: ResponsesRequest,
    model: str,
    output: list[dict],
    finish: str,
    prompt_tokens: int,
    output_tokens: int,
) -> dict[str, Any]:
    """The response object: `incomplete` when the output ran out of max_output_tokens."""
    incomplete = finish == "length"
    tool_choice = req.tool_choice
    if isinstance(tool_choice, BaseModel):
        tool_choice = tool_choice.model_dump()
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "model": model,
        "output": output,
        "instructions": req.instructions,
        "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
        "tool_choice": tool_choice or "auto",
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "max_output_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "metadata": req.metadata or {},
        "store": req.store is not False,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "usage": {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens,
        },
    }


def stream_events(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The Responses stream of a finished response: created, in_progress, each output
    item (added, its text or arguments as one delta, done), completed (or incomplete)."""
    events: list[dict[str, Any]] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append({"type": kind, "sequence_number": len(events), **fields})

    pending = {**body, "status": "in_progress", "output": [], "incomplete_details": None}
    emit("response.created", response=pending)
    emit("response.in_progress", response=pending)
    for index, item in enumerate(body["output"]):
        where = {"output_index": index, "item_id": item["id"]}
        if item["type"] == "function_call":
            emit("response.output_item.added", output_index=index, item={**item, "arguments": ""})
            emit("response.function_call_arguments.delta", **where, delta=item["arguments"])
            emit("response.function_call_arguments.done", **where, arguments=item["arguments"])
        else:
            emit("response.output_item.added", output_index=index, item={**item, "content": []})
            for k, part in enumerate(item["content"]):
                at = {**where, "content_index": k}
                emit("response.content_part.added", **at, part={**part, "text": ""})
                text, logprobs = part["text"], part["logprobs"]
                emit("response.output_text.delta", **at, delta=text, logprobs=logprobs)
                emit("response.output_text.done", **at, text=text, logprobs=logprobs)
                emit("response.content_part.done", **at, part=part)
        emit("response.output_item.done", output_index=index, item=item)
    emit(f"response.{body['status']}", response=body)
    return events


def error_event(error: dict[str, Any]) -> dict[str, Any]:
    """The stream's `error` event for an OpenAI error body (the engine failed, or the
    session closed): the error's type is the event's `code`."""
    detail = error["error"]
    return {
        "type": "error",
        "sequence_number": 0,
        "code": detail["type"],
        "message": detail["message"],
        "param": detail["param"],
    }
