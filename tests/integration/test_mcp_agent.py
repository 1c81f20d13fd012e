"""An OpenAI Agents SDK agent whose tools are an MCP server's, trained unchanged.

examples/calculator/agent_mcp.py starts examples/calculator/mcp_server.py per rollout
(a real stdio child process) and runs the tool model (tests/support/tool_model.py,
greedy) through the real controller, gateway and engine: the model's call is parsed
from its sampled tokens, the SDK runs it on the MCP server and sends the server's
result back, and the whole session trains as one sample. No server outlives its
rollout.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from agents import Agent, Model, ModelResponse, Runner, Usage
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

from examples.calculator.agent_mcp import CalculatorMCPAgent, calculator_server, tool_results
from examples.calculator.tools import score
from looprl import startup
from looprl.models import load_tokenizer
from looprl.scheduling.single_process import start_single_process
from tests.support.tiny_run import train_tool_agent_two_steps
from tests.support.tool_model import assert_one_sample_round_trip, greedy_config

ROW = {"question": "What is 2 + 3?", "answer": 5}
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "command",
    [["-m", "examples.calculator.mcp_server"], [str(REPO / "examples/calculator/mcp_server.py")]],
    ids=["module", "path"],
)
async def test_the_mcp_server_serves_add_and_multiply(command, tmp_path, no_leaked_children):
    """Started either way (by path from another directory), it lists both tools and
    answers a call with the number as text."""
    cwd = REPO if command[0] == "-m" else tmp_path
    params = StdioServerParameters(command=sys.executable, args=command, cwd=cwd)
    async with stdio_client(params) as streams, ClientSession(*streams) as session:
        await session.initialize()
        listed = await session.list_tools()
        result = await session.call_tool("multiply", {"a": 4, "b": 2.5})
    assert sorted(t.name for t in listed.tools) == ["add", "multiply"]
    assert [c.text for c in result.content] == ["10"]


class _ScriptedModel(Model):
    """A model that calls `add` three ways at once (right, with an argument the server
    rejects, with arguments that are not JSON), then answers."""

    def __init__(self):
        calls = ['{"a": 2, "b": 3}', '{"a": "two", "b": 3}', "not json"]
        answer = ResponseOutputText(type="output_text", text="The answer is 5.", annotations=[])
        self.turns = [
            [
                ResponseFunctionToolCall(
                    type="function_call", call_id=f"call_{i}", name="add", arguments=arguments
                )
                for i, arguments in enumerate(calls)
            ],
            [
                ResponseOutputMessage(
                    type="message", id="m", role="assistant", status="completed", content=[answer]
                )
            ],
        ]

    async def get_response(self, *args, **kwargs) -> ModelResponse:
        return ModelResponse(output=self.turns.pop(0), usage=Usage(), response_id=None)

    def stream_response(self, *args, **kwargs):
        raise NotImplementedError("the test runs unstreamed")


async def test_calls_the_server_rejects_score_as_errors(no_leaked_children):
    """The reward reads the server's result of each call, and a call it could not run as
    `tools.call_tool`'s "error: ..." (0.25 when no call ran, as for the other agents)."""
    async with calculator_server() as server:
        agent = Agent(name="calculator", mcp_servers=[server], model=_ScriptedModel())
        result = await Runner.run(agent, ROW["question"])
    results = tool_results(result.new_items)
    good, rejected, not_json = results
    assert good == "5"
    assert rejected.startswith("error: Error executing tool add: 1 validation error")
    assert not_json.startswith("error: An error occurred while running the tool")
    assert score(result.final_output, 5, results) == 1.0
    assert score(result.final_output, 5, results[1:]) == 0.25  # as a call_tool error scores


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_mcp_agent_round_trips_a_server_tool_call_into_one_sample(
    tool_model_dir, api, no_leaked_children
):
    tokenizer = load_tokenizer(tool_model_dir)
    agent = CalculatorMCPAgent(api=api)
    async with start_single_process(
        startup.start(greedy_config(tool_model_dir), train=False), agent
    ) as parts:
        result = await parts.controller.rollout_batch([ROW])
    # what the MCP server answered, sent back by the SDK as the tool message
    assert_one_sample_round_trip(result, tokenizer)


async def test_mcp_agent_trains_two_steps(tool_model_dir, tmp_path, no_leaked_children):
    overrides = "workflow.kwargs={max_turns: 2}"
    await train_tool_agent_two_steps(tool_model_dir, tmp_path, CalculatorMCPAgent, overrides)
