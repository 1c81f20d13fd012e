"""The gateway's request bodies: OpenAI's chat/completions and completions fields (with
vLLM's `top_k` and looprl's session reward), validated at the edge, each limit named."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_validator

MAX_N = 128  # choices per request: bounds the work one request can queue

StopString = Annotated[str, Field(min_length=1)]


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


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template and tools.render_messages take it."""
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


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
    prompt: str | list[Annotated[int, Field(ge=0)]]
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
