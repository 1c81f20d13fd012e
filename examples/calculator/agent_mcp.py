"""The calculator agent written with the OpenAI Agents SDK, its tools an MCP server's.

Each rollout starts its own `examples/calculator/mcp_server.py` as a child process
(`MCPServerStdio`, same interpreter) and stops it when the rollout ends, so rollouts
share no tool state and no server outlives its rollout. The SDK lists the server's
tools, sends them to the model and runs the model's calls on the server. The server
gets only MCP's default environment (PATH, HOME, ...), not the agent's.

The model is the SDK's chat-completions model (`api="chat"`) or its default Responses
model (`api="responses"`), either pointed at the session's base_url; tracing is off
because it would upload traces to OpenAI. The reward is `tools.score` of the final
answer and the tool results, read from the run's `ToolCallOutputItem`s (what the
server returned is what the model saw), a call the server rejected counting as an
error as the other agents' `call_tool` counts it.
"""

import sys
from pathlib import Path

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    ToolCallOutputItem,
    set_tracing_disabled,
)
from agents.exceptions import MaxTurnsExceeded
from agents.mcp import MCPServerStdio
from openai import AsyncOpenAI

from examples.calculator.tools import SYSTEM_PROMPT, score

set_tracing_disabled(True)

SERVER = Path(__file__).with_name("mcp_server.py")
MODELS = {"chat": OpenAIChatCompletionsModel, "responses": OpenAIResponsesModel}


def calculator_server() -> MCPServerStdio:
    """A client for a new mcp_server.py process, started on `async with` and stopped on
    its exit. Each tool output item's `custom_data` says whether the server flagged the
    call as an error (arguments it could not use)."""
    return MCPServerStdio(
        {"command": sys.executable, "args": [str(SERVER)]},
        name="calculator",
        cache_tools_list=True,  # one server per rollout: its tools never change
        custom_data_extractor=lambda call: {"is_error": bool(call.is_error)},
    )


def tool_results(items: list) -> list[str]:
    """The tool results among a run's items, as `tools.score` reads them: the server's
    text, or "error: ..." for a call the server flagged as an error or the SDK could not
    make (arguments that are not JSON; its own message, no custom_data)."""
    results = []
    for item in items:
        if isinstance(item, ToolCallOutputItem):
            text = _text(item.output)
            results.append(text if item.custom_data == {"is_error": False} else f"error: {text}")
    return results


def _text(output) -> str:
    """An MCP tool's output as the SDK hands it back: one text block
    ({"type": "text", "text": "5"}), a list of blocks, or the SDK's error message."""
    if isinstance(output, dict):
        return output.get("text", "")
    if isinstance(output, list):
        return "".join(map(_text, output))
    return str(output)


class CalculatorMCPAgent:
    """`api`: "chat" (OpenAIChatCompletionsModel, /v1/chat/completions) or "responses"
    (OpenAIResponsesModel, /v1/responses)."""

    def __init__(self, max_turns: int = 3, api: str = "chat"):
        if api not in MODELS:
            raise ValueError(f"CalculatorMCPAgent: api={api!r}; use one of {', '.join(MODELS)}")
        self.max_turns = max_turns
        self.api = api

    async def run(self, data, *, base_url, api_key, model, **kw):
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        async with client, calculator_server() as server:
            agent = Agent(
                name="calculator",
                instructions=SYSTEM_PROMPT,
                mcp_servers=[server],
                model=MODELS[self.api](model=model, openai_client=client),
                model_settings=ModelSettings(tool_choice="auto"),
            )
            try:
                result = await Runner.run(agent, data["question"], max_turns=self.max_turns)
                items, final = result.new_items, str(result.final_output)
            except MaxTurnsExceeded as e:
                items, final = e.run_data.new_items if e.run_data else [], None
        return score(final, data["answer"], tool_results(items))
