"""The calculator agent written with the OpenAI Agents SDK (`openai-agents`), unchanged.

`api="responses"` runs it on the SDK's default model, `OpenAIResponsesModel` (the
Responses API); `api="chat"` on `OpenAIChatCompletionsModel`. Either is pointed at the
session's base_url; tracing is off because it would upload traces to OpenAI.
"""

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.exceptions import MaxTurnsExceeded
from openai import AsyncOpenAI

from examples.calculator import tools
from examples.calculator.tools import SYSTEM_PROMPT, format_number, score

set_tracing_disabled(True)

MODELS = {"chat": OpenAIChatCompletionsModel, "responses": OpenAIResponsesModel}


class CalculatorSDKAgent:
    def __init__(self, max_turns: int = 3, api: str = "chat"):
        if api not in MODELS:
            raise ValueError(f"api={api!r}: choose one of {', '.join(MODELS)}")
        self.max_turns = max_turns
        self.api = api

    async def run(self, data, *, base_url, api_key, model, **kw):
        results: list[str] = []

        @function_tool
        def add(a: float, b: float) -> str:
            """Add two numbers."""
            results.append(format_number(tools.add(a, b)))
            return results[-1]

        @function_tool
        def multiply(a: float, b: float) -> str:
            """Multiply two numbers."""
            results.append(format_number(tools.multiply(a, b)))
            return results[-1]

        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        agent = Agent(
            name="calculator",
            instructions=SYSTEM_PROMPT,
            tools=[add, multiply],
            model=MODELS[self.api](model=model, openai_client=client),
            model_settings=ModelSettings(tool_choice="auto"),
        )
        try:
            result = await Runner.run(agent, data["question"], max_turns=self.max_turns)
            final = str(result.final_output)
        except MaxTurnsExceeded:
            final = None
        finally:
            await client.close()
        return score(final, data["answer"], results)
