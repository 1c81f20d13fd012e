"""Agents written with three frameworks, unchanged, trained through the gateway.

Each calculator agent in examples/calculator (plain `openai`, the OpenAI Agents SDK,
LangChain) runs through the real controller, gateway and engine on the tool model
(tests/support/tool_model.py: a tiny model fine-tuned to call `add`, greedy). Every rollout
is a real round trip: the model's tool call is parsed from its sampled tokens, the
framework runs the tool and sends the result back as a `role: tool` message, and the
next call's prompt extends the tokens sampled so far, so the session is one sample.
"""

from __future__ import annotations

import pytest

from examples.calculator.agent_langchain import CalculatorLangChainAgent
from examples.calculator.agent_openai import CalculatorAgent
from examples.calculator.agent_sdk import CalculatorSDKAgent
from looprl import startup
from looprl.models import load_tokenizer
from looprl.scheduling.single_process import start_single_process
from tests.support.tool_model import assert_one_sample_round_trip, greedy_config

ROW = {"question": "What is 2 + 3?", "answer": 5}


@pytest.mark.parametrize(
    "agent", [CalculatorAgent(), CalculatorSDKAgent(), CalculatorLangChainAgent()], ids=type
)
async def test_framework_agents_round_trip_a_tool_call_into_one_sample(tool_model_dir, agent):
    tokenizer = load_tokenizer(tool_model_dir)
    async with start_single_process(
        startup.start(greedy_config(tool_model_dir), train=False), agent
    ) as parts:
        result = await parts.controller.rollout_batch([ROW])
    assert_one_sample_round_trip(result, tokenizer)
