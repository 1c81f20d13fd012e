"""The gateway's request bodies: OpenAI's chat/completions and completions fields (with
vLLM's `top_k` and looprl's session reward), validated at the edge, each limit named."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, Discriminator, Field, Tag, model_validator

MAX_N = 128  # choices per request: bounds the work one request can queue


def _finite(value: Any) -> Any:
    """Python's JSON parser takes Infinity and NaN, which are not JSON: no answer that
    echoes the value (the Responses API's tools) could carry them back."""
    stack = [value]
    while stack:  # as deep as the body (gateway.limits.max_json_depth)
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{item} is not a JSON number: send finite numbers")
    return value


JSONObject = Annotated[dict[str, Any], AfterValidator(_finite)]
StopString = Annotated[str, Field(min_length=1)]


ITEM_TYPE_ERROR = "item_type"  # a `tagged` union's error: its value's `type` is none of them


def tagged(default: str | None, **members: type[BaseModel]) -> Any:
    """A union of `members` (keyed by their `type` value) told apart by the `type` field,
    `default` where a value has none. The tags (`item:<type>`) are not identifiers, so an
    error's path names the field and not the member (errors._param)."""

    def kind(value: Any) -> str:
        if isinstance(value, dict):
            return f"item:{value.get('type', default)}"
        return f"item:{getattr(value, 'type', default)}"

    choices = tuple(Annotated[model, Tag(f"item:{name}")] for name, model in members.items())
    expected = ", ".join(members)
    return Annotated[
        Union[choices],  # noqa: UP007 (a tuple of members has no `|` spelling)
        Discriminator(
            kind,
            custom_error_type=ITEM_TYPE_ERROR,
            custom_error_message=f"unsupported or missing type; supported: {expected}",
        ),
    ]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class _Message(BaseModel):
    """What every chat message has; the subclasses say which fields each role needs."""

    content: str | list[TextPart] | None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template and tools.render_messages take it."""
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text()}


Content = str | list[TextPart]


class SystemMessage(_Message):
    role: Literal["system", "developer"]
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: Content


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None

    @model_validator(mode="after")
    def _says_something(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self

    def for_template(self) -> dict[str, Any]:
        out = super().for_template()
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return out


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str

    def for_template(self) -> dict[str, Any]:
        return {**super().for_template(), "tool_call_id": self.tool_call_id}


ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]
ROLES = ("system", "developer", "user", "assistant", "tool")


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by chat and text completions; null means "not given"."""

    model: str | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)
    max_tokens: int | None = Field(None, ge=1)
    stop: StopString | list[StopString] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool | None = None
    stream_options: StreamOptions | None = None


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self) -> ChatRequest:
        names = [t.function.name for t in self.tools or []]
        if self.tool_choice not in (None, "none") and not names:
            raise ValueError(f"tool_choice: {self._choice()!r} needs tools")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(
                f"tool_choice: names {choice.function.name!r}, which is not among the tools "
                f"({', '.join(names)})"
            )
        return self

    def _choice(self) -> str | dict | None:
        choice = self.tool_choice
        return choice.model_dump() if isinstance(choice, BaseModel) else choice

    def active_tools(self) -> tuple[list[dict], str | dict | None]:
        """The tool definitions the model sees and the tool_choice, or ([], None)."""
        if not self.tools or self.tool_choice == "none":
            return [], None
        return [t.model_dump(exclude_none=True) for t in self.tools], self._choice()


class CompletionRequest(SamplingRequest):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    )
    logprobs: int | None = Field(None, ge=0, le=20)


class RewardRequest(BaseModel):
    reward: float | None = Field(None, allow_inf_nan=False)
    rewards: dict[str, Annotated[float, Field(allow_inf_nan=False)]] | None = None
    completion_id: str | None = None

    @model_validator(mode="after")
    def _one_shape(self) -> RewardRequest:
        if (self.reward is None) == (self.rewards is None):
            raise ValueError(
                'give either "reward" (with an optional "completion_id") or '
                '"rewards" ({completion_id: reward})'
            )
        if self.completion_id is not None and self.rewards is not None:
            raise ValueError('"completion_id" goes with "reward", not with "rewards"')
        return self

    def value(self) -> float | dict[str, float]:
        if self.rewards is not None:
            return self.rewards
        if self.completion_id is not None:
            return {self.completion_id: self.reward}
        return self.reward


# ---- responses: what the routes answer, as documented in the OpenAPI schema ----------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ResponseMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


ResponseFinishReason = Literal["stop", "length", "tool_calls", "abort"]


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: ResponseFinishReason
    token_ids: list[int]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: ResponseFinishReason
    token_ids: list[int]


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    prompt_token_ids: list[int]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class RewardResponse(BaseModel):
    session_id: str
    reward: float | dict[str, float] | None


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[TokenLogprob]


class OutputMessage(BaseModel):
    type: Literal["message"]
    id: str
    status: Literal["completed"]
    role: Literal["assistant"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["completed"]


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """The Responses API's answer (openai_responses.response_body), with vLLM's token ids."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete"]
    error: None
    incomplete_details: IncompleteDetails | None
    model: str
    output: list[Annotated[OutputMessage | OutputFunctionCall, Field(discriminator="type")]]
    instructions: str | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    previous_response_id: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    metadata: dict[str, str]
    store: bool
    text: dict[str, Any]
    truncation: Literal["disabled"]
    usage: ResponseUsage
    prompt_token_ids: list[int]
    output_token_ids: list[int]


class AnthropicTextBlock(BaseModel):
    type: Literal["text"]
    text: str


class AnthropicToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


class AnthropicMessage(BaseModel):
    """The Messages API's answer (anthropic_messages.message_body)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[
        Annotated[AnthropicTextBlock | AnthropicToolUseBlock, Field(discriminator="type")]
    ]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: AnthropicUsage


class TokenCount(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """An error on the Messages routes: the field's path starts the message."""

    type: Literal["error"]
    error: AnthropicErrorDetail


def documented(model: type[BaseModel] | None, *statuses: int, stream: bool = False) -> dict:
    """FastAPI `responses=` for a route answering `model` (200) or an error at each of
    `statuses` in the shape of `model`'s API (an AnthropicError for the Messages API's
    answers, as errors.anthropic_route, else an ErrorResponse); `stream` adds
    text/event-stream to the 200."""
    error = AnthropicError if model in (AnthropicMessage, TokenCount) else ErrorResponse
    out: dict[int | str, dict[str, Any]] = {
        status: {"model": error, "description": ERROR_STATUSES[status]} for status in statuses
    }
    if model is not None:
        out[200] = {"model": model, "description": "OK"}
        if stream:
            # One event per chunk: `data` holds a JSON chunk, or "[DONE]" at the end; the
            # Responses and Messages streams name each event by its type (`event`).
            event = {
                "type": "object",
                "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
                "required": ["data"],
            }
            out[200]["content"] = {"text/event-stream": {"schema": event}}
    return out


ERROR_STATUSES = {
    400: "The request is invalid or beyond a limit; the error names the field (`param`, "
    "or the start of an Anthropic error's message)",
    401: "The session is not open or the API key is wrong",
    404: "The session closed while the call was generating",
    413: "The body is larger than gateway.limits.max_request_bytes",
    500: "A bug in looprl; the gateway's log has the traceback",
    503: "The engine cannot serve requests now",
}
