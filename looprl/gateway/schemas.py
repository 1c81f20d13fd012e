"""The gateway's request bodies: OpenAI's chat/completions and completions fields (with
vLLM's `top_k` and looprl's session reward), validated at the edge, each limit named."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, model_validator

MAX_N = 128  # choices per request: bounds the work one request can queue


def _unicode(text: str) -> str:
    """JSON may escape half a surrogate pair (\\ud800); such text is not Unicode and no
    tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"the text holds a lone surrogate ({text[e.start]!r} at character {e.start}), "
            "which is not Unicode: send UTF-8 text"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]
StopString = Annotated[Text, Field(min_length=1)]


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ToolCallFunction(BaseModel):
    name: str
    arguments: Text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class _Message(BaseModel):
    """What every chat message has; the subclasses say which fields each role needs."""

    content: Text | list[TextPart] | None

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


Content = Text | list[TextPart]


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
    description: Text | None = None
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
            raise ValueError(f"tool_choice={self._choice()!r} needs tools")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(
                f"tool_choice names {choice.function.name!r}, which is not among the tools "
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
        Annotated[Text, Field(min_length=1)]
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


def documented(model: type[BaseModel] | None, *statuses: int, stream: bool = False) -> dict:
    """FastAPI `responses=` for a route answering `model` (200) or an ErrorResponse at
    each of `statuses`; `stream` adds text/event-stream to the 200."""
    out: dict[int | str, dict[str, Any]] = {
        status: {"model": ErrorResponse, "description": ERROR_STATUSES[status]}
        for status in statuses
    }
    if model is not None:
        out[200] = {"model": model, "description": "OK"}
        if stream:
            # One event per chunk: `data` holds a JSON chunk, or "[DONE]" at the end.
            event = {
                "type": "object",
                "properties": {"data": {"type": "string"}},
                "required": ["data"],
            }
            out[200]["content"] = {"text/event-stream": {"schema": event}}
    return out


ERROR_STATUSES = {
    400: "The request is invalid or beyond a limit; `param` names the field",
    401: "The session is not open or the API key is wrong",
    404: "The session closed while the call was generating",
    413: "The body is larger than gateway.limits.max_request_bytes",
    500: "A bug in looprl; the gateway's log has the traceback",
    503: "The engine cannot serve requests now",
}
