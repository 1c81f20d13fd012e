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
from tests.support.tool_model import ANSWER, CALL, greedy_config

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
    stats = result.stats()
    assert stats["completed"] == 1, stats
    assert stats["reward_mean"] == 1.0  # the tool ran, and the answer used its result
    # the tiny model sometimes calls the tool once more before answering: calls >= 2
    calls = stats["calls"]
    assert calls >= 2 and stats["concat_breaks"] == 0
    assert stats["tool_call_errors"] == 0
    (sample,) = result.trajectories
    sampled = sample.input_ids[sample.loss_mask].tolist()
    call_ids = [*tokenizer(CALL, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    answer_ids = [*tokenizer(ANSWER, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    assert sampled == call_ids * (calls - 1) + answer_ids  # the outputs, nothing sent back
    unmasked = tokenizer.decode(sample.input_ids[~sample.loss_mask])
    assert unmasked.count("<tool_response>\n5\n</tool_response>") == calls - 1
    transitions = sample.loss_mask.int().diff().ne(0).sum()
    assert transitions == 2 * calls - 1  # one run of sampled tokens per call, the last at the end
