"""Anthropic's Messages API (`POST /v1/messages`) on top of the gateway's chat path.

Owns: the request body (`system`, messages of content blocks, tools with `input_schema`,
`tool_choice`, `stop_sequences`, sampling fields), turning it into the chat request the
gateway already serves (so the prompt, the tool format, the sampled-id reuse and the
recording are the chat path's, and one conversation gives the same tokens over any
API), and the answers: the message with its content blocks, and the stream of
Anthropic's events built from it. Does not own HTTP, auth (`x-api-key` or Bearer) or
the error shape (errors.py), nor sampling.

What a request becomes:
- `system` (a string or text blocks joined with "\\n") is a system message;
- a user message's text blocks are a user message, each `tool_result` block a
  `role: tool` message for its `tool_use_id`, in the order they come;
- an assistant message's text blocks are its content and its `tool_use` blocks its
  tool calls (the input as JSON arguments); `thinking` blocks are dropped;
- `tool_choice` `auto`/`any`/`tool`/`none` is chat's `auto`/`required`/a named
  function/`none`, and `disable_parallel_tool_use` is `parallel_tool_calls: false`.

Where it departs from Anthropic: `model` may be any name; an assistant message last
(a prefill) is a 400, as are images, documents and server tools (web search, bash,
...), each naming the block or tool; `thinking`, `metadata`, `cache_control` are
accepted and ignored; `temperature` may exceed 1 (to 2, as OpenAI's).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from looprl.gateway.schemas import StopString, tagged


class TextBlock(BaseModel):
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(block.text for block in self.content)


class ThinkingBlock(BaseModel):
    type: Literal["thinking", "redacted_thinking"]


ContentBlock = tagged(
    None,
    text=TextBlock,
    tool_use=ToolUseBlock,
    tool_result=ToolResultBlock,
    thinking=ThinkingBlock,
    redacted_thinking=ThinkingBlock,
)


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def chat_messages(self) -> list[dict[str, Any]]:
        """This message as chat messages (a user message may become several)."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        if self.role == "assistant":
            texts = [b.text for b in self.content if isinstance(b, TextBlock)]
            calls = [
                {
                    "id": b.id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": json.dumps(b.input)},
                }
                for b in self.content
                if isinstance(b, ToolUseBlock)
            ]
            message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
            if calls:
                message["tool_calls"] = calls
            return [message]
        out: list[dict[str, Any]] = []
        texts: list[str] = []
        for block in self.content:
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolResultBlock):
                if texts:
                    out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                result = {"role": "tool", "tool_call_id": block.tool_use_id}
                out.append({**result, "content": block.text()})
        if texts or not out:
            out.append({"role": "user", "content": "\n".join(texts)})
        return out


class Tool(BaseModel):
    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named_when_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('tool_choice: "name" goes with type "tool", and only with it')
        return self


class CountTokensRequest(BaseModel):
    """`/v1/messages/count_tokens`: the conversation part of a Messages request."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    def chat_request(self) -> dict[str, Any]:
        """The chat request's fields."""
        messages: list[dict[str, Any]] = []
        if self.system:
            system = self.system
            if not isinstance(system, str):
                system = "\n".join(block.text for block in system)
            messages.append({"role": "system", "content": system})
        for message in self.messages:
            messages.extend(message.chat_messages())
        fields: dict[str, Any] = {"messages": messages}
        if self.tools:
            fields["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        **({"description": t.description} if t.description else {}),
                        "parameters": t.input_schema,
                    },
                }
                for t in self.tools
            ]
        choice = self.tool_choice
        if choice is not None:
            kinds = {"auto": "auto", "any": "required", "none": "none"}
            named = {"type": "function", "function": {"name": choice.name}}
            fields["tool_choice"] = named if choice.type == "tool" else kinds[choice.type]
            if choice.disable_parallel_tool_use:
                fields["parallel_tool_calls"] = False
        return fields


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[StopString] | None = None
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)
    stream: bool | None = None
    metadata: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _ends_with_the_user(self) -> MessagesRequest:
        if self.messages[-1].role == "assistant":
            raise ValueError(
                f"messages[{len(self.messages) - 1}]: the last message is the assistant's "
                "(a prefill), which the gateway does not continue; end with a user message"
            )
        return self

    def chat_request(self) -> dict[str, Any]:
        return {
            **super().chat_request(),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences or None,
        }


# ---- answers -----------------------------------------------------------------------


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice's assistant message as content blocks: its text (if any, or if there
    are no calls), then one tool_use block per call."""
    calls = message.get("tool_calls") or []
    blocks = []
    if message.get("content") or not calls:
        blocks.append({"type": "text", "text": message.get("content") or ""})
    for call in calls:
        function = call["function"]
        arguments = json.loads(function["arguments"])
        blocks.append({"type": "tool_use", "id": call["id"], "name": function["name"]})
        blocks[-1]["input"] = arguments
    return blocks


def stop_reason(finish: str, stop: str | None) -> str:
    """Anthropic's stop_reason for a chat finish_reason (`stop` with a stop string hit is
    `stop_sequence`)."""
    if finish == "tool_calls":
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if stop is not None else "end_turn"


def message_body(
    message_id: str,
    model: str,
    blocks: list[dict[str, Any]],
    reason: str,
    stop: str | None,
    prompt_tokens: int,
    output_tokens: int,
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": stop,
        "usage": {
            "input_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


def stream_events(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Anthropic's stream of a finished message: message_start, each content block
    (start, its text or input JSON as one delta, stop), message_delta, message_stop."""
    usage = body["usage"]
    start = {
        **body,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {**usage, "output_tokens": 0},
    }
    events: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
    for index, block in enumerate(body["content"]):
        if block["type"] == "tool_use":
            empty = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        else:
            empty = {**block, "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
        events.append({"type": "content_block_start", "index": index, "content_block": empty})
        events.append({"type": "content_block_delta", "index": index, "delta": delta})
        events.append({"type": "content_block_stop", "index": index})
    events.append(
        {
            "type": "message_delta",
            "delta": {"stop_reason": body["stop_reason"], "stop_sequence": body["stop_sequence"]},
            "usage": {"output_tokens": usage["output_tokens"]},
        }
    )
    events.append({"type": "message_stop"})
    return events


def new_id() -> str:
    return f"msg_{uuid.uuid4().hex}"
