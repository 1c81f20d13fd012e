"""A Claude Agent SDK agent, trained unchanged: the real Claude Code CLI against the gateway.

examples/calculator/agent_claude.py runs the CLI the SDK bundles, pointed by
ANTHROPIC_BASE_URL at the session, with the calculator's tools as an in-process MCP
server (`mcp__calculator__add`). The tool model of tests/support/tool_model.py knows
neither that name nor Claude Code's prompt (its system blocks, the environment block
sent as `<system-reminder>` text), so `claude_model_dir` teaches the tiny model the
same two answers on the prompts the CLI really sends: it runs the agent twice per
question on the untrained model (each rollout in a new working directory, which the
prompt names), takes each first call's messages as the session recorded them, and
fine-tunes on (those messages -> the call to
`mcp__calculator__add`) and (the same with the call and its result "5" -> the answer).
Then a rollout through the real controller, gateway and engine is one sample, the call
then the answer, and two training steps run. No CLI outlives its rollout.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import string
from pathlib import Path

import pytest

pytest.importorskip("claude_agent_sdk", reason="needs `pip install claude-agent-sdk`")

from examples.calculator.agent_claude import SERVER, CalculatorClaudeAgent
from examples.calculator.tools import TOOLS
from looprl import startup
from looprl.config import SamplingConfig
from looprl.gateway import prompts
from looprl.gateway import tools as tools_lib
from looprl.gateway.schemas import ChatRequest
from looprl.models import load_model, load_tokenizer
from looprl.scheduling.single_process import start_single_process
from tests.support.local_gateway import local_gateway
from tests.support.tiny_run import train_tool_agent_two_steps
from tests.support.tool_model import (
    ANSWER,
    assert_one_sample_round_trip,
    fine_tune,
    greedy_config,
)

# The fixture fine-tunes the tiny model 160 steps on the CLI's prompts (16, renamed): ~2 min on 2
# cores, past the fast tier's 300 s deadline on a loaded machine.
pytestmark = pytest.mark.slow

ROW = {"question": "What is 2 + 3?", "answer": 5}
QUESTIONS = ["What is 2 + 3?", "Add 2 and 3."]
ADD = f"mcp__{SERVER}__add"
CALL = tools_lib.format_call(ADD, {"a": 2, "b": 3})
# The calculator's tools as the CLI lists them to the model, as chat tools.
CLAUDE_TOOLS = [
    {"type": "function", "function": {**f, "name": f"mcp__{SERVER}__{f['name']}"}}
    for f in (t["function"] for t in TOOLS)
]


async def _first_calls(model_dir: Path) -> list[tuple[list[dict], list[int]]]:
    """(chat messages, prompt ids) of the CLI's first model call, as the gateway recorded
    them, for two rollouts per question."""
    tokenizer = load_tokenizer(model_dir)
    greedy = SamplingConfig(temperature=0, max_new_tokens=40)
    agent = CalculatorClaudeAgent()
    calls = []
    async with local_gateway(
        load_model(model_dir), tokenizer, model_name="calc", default_sampling=greedy
    ) as server:
        for question in [*QUESTIONS, *QUESTIONS]:
            handle = server.open_session()
            row = {"question": question, "answer": 5}
            await agent.run(row, base_url=handle.base_url, api_key=handle.api_key, model="calc")
            first = server.close_session(handle.id).interactions[0]
            calls.append((first.messages, first.prompt_ids))
    return calls


def _prompt(tokenizer, messages: list[dict]) -> list[int]:
    """The gateway's prompt for `messages` with the calculator's tools offered."""
    req = ChatRequest.model_validate({"messages": messages, "tools": CLAUDE_TOOLS})
    tools, _ = req.active_tools()
    native = tools_lib.template_renders_tools(tokenizer.chat_template)
    return prompts.chat_prompt(tokenizer, req, tools, "", None, native_tools=native)


# The CLI names its working directory in the prompt: a fresh temporary one per rollout.
_WORKDIR = re.compile(r"claude-agent-[A-Za-z0-9_]+")
_RENAMES = 3  # more names per recorded call, so the model learns the name does not matter


def _renamed(messages: list[dict], seed: int) -> list[dict]:
    """`messages` with the working directory's random name replaced by another."""
    rng = random.Random(seed)
    name = "claude-agent-" + "".join(rng.choices(string.ascii_lowercase + string.digits, k=8))
    return json.loads(_WORKDIR.sub(name, json.dumps(messages)))


def _claude_conversations(tokenizer, first_calls) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids): each first call -> CALL, and it with CALL and the
    result "5" sent back -> ANSWER; each also with the working directory renamed
    `_RENAMES` times. Without the renames the model saw four names, and a rollout in a
    fifth directory broke its call's JSON in about one CI run of three (at d5d52e1 and
    1392f0c: `{"name": "mcp__add", "mcp__add", ...}`)."""
    recorded = first_calls
    first_calls = [
        (_renamed(messages, seed=n * 100 + k), None)
        for n, (messages, _) in enumerate(recorded)
        for k in range(_RENAMES)
    ]
    first_calls = [*recorded, *first_calls]
    pairs = []
    function = {"name": ADD, "arguments": '{"a": 2, "b": 3}'}
    call = {"id": "call_0", "type": "function", "function": function}
    sent_back = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "5"},
    ]
    for messages, prompt_ids in first_calls:
        if prompt_ids is not None:  # the prompt the CLI got, rebuilt
            assert _prompt(tokenizer, messages) == prompt_ids
        for prompt, target in ((messages, CALL), ([*messages, *sent_back], ANSWER)):
            out = tokenizer(target, add_special_tokens=False).input_ids
            pairs.append((_prompt(tokenizer, prompt), [*out, tokenizer.eos_token_id]))
    return pairs


@pytest.fixture(scope="module")
def claude_model_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny model fine-tuned to call `mcp__calculator__add` on Claude Code's prompt."""
    first_calls = asyncio.run(_first_calls(tiny_model_dir))
    pairs = _claude_conversations(load_tokenizer(tiny_model_dir), first_calls)
    # 160 steps: after 40, once in CI, one greedy held-out call did not parse before any
    # training; after 80, on 2026-11-28, every run's second call broke its JSON (the
    # fixture fits the CLI's prompt of the day, whose text moves with its environment)
    return fine_tune(tiny_model_dir, tmp_path_factory.mktemp("claude-llama"), pairs, steps=160)


async def test_claude_agent_round_trips_a_tool_call_into_one_sample(
    claude_model_dir, no_leaked_children
):
    tokenizer = load_tokenizer(claude_model_dir)
    agent = CalculatorClaudeAgent()
    async with start_single_process(
        startup.start(greedy_config(claude_model_dir), train=False), agent
    ) as parts:
        result = await parts.controller.rollout_batch([ROW])
    # the call, then the answer: the CLI's refused first request is not a call
    unmasked = assert_one_sample_round_trip(result, tokenizer, calls=2, call=CALL)
    assert "<system-reminder>\n# Environment" in unmasked  # Claude Code's own context


async def test_claude_agent_trains_two_steps(claude_model_dir, tmp_path, no_leaked_children):
    overrides = "workflow.kwargs={max_turns: 2}"
    await train_tool_agent_two_steps(claude_model_dir, tmp_path, CalculatorClaudeAgent, overrides)
