"""The calculator agent written with LangGraph and with Pydantic AI, unchanged, through
the gateway and trained.

As in tests/integration/test_agents.py, each agent runs on the tool model
(tests/support/tool_model.py, greedy) through the real controller, gateway and engine:
the model's tool call is parsed from its sampled tokens, the framework runs the tool and
sends the result back as a `role: tool` message, and the session is one sample. Then
each agent is `workflow.path` of a real two-step `looprl train` (tests/support/tiny_run.py)
on the arithmetic task, sampled at temperature 1, and nothing it plays is lost on the way
to the trainer.
"""

from __future__ import annotations

import pytest

from examples.calculator.agent_langgraph import CalculatorLangGraphAgent
from examples.calculator.agent_pydantic_ai import CalculatorPydanticAIAgent
from looprl import startup
from looprl.models import load_tokenizer
from looprl.scheduling.single_process import start_single_process
from tests.support.tiny_run import train_tool_agent_two_steps
from tests.support.tool_model import assert_one_sample_round_trip, greedy_config

ROW = {"question": "What is 2 + 3?", "answer": 5}
AGENTS = [CalculatorLangGraphAgent, CalculatorPydanticAIAgent]


@pytest.mark.parametrize("agent_class", AGENTS, ids=lambda c: c.__name__)
async def test_agent_round_trips_a_tool_call_into_one_sample(tool_model_dir, agent_class):
    tokenizer = load_tokenizer(tool_model_dir)
    async with start_single_process(
        startup.start(greedy_config(tool_model_dir), train=False), agent_class()
    ) as parts:
        result = await parts.controller.rollout_batch([ROW])
    assert_one_sample_round_trip(result, tokenizer)


@pytest.mark.parametrize("agent_class", AGENTS, ids=lambda c: c.__name__)
async def test_an_agent_out_of_turns_scores_its_tool_results_without_an_answer(
    tool_model_dir, agent_class
):
    """With one turn the model's call runs, and the run ends before it answers: 0.5."""
    async with start_single_process(
        startup.start(greedy_config(tool_model_dir), train=False), agent_class(max_turns=1)
    ) as parts:
        result = await parts.controller.rollout_batch([ROW])
    stats = result.stats()
    assert stats["completed"] == 1 and stats["calls"] == 1, stats
    assert stats["reward_mean"] == 0.5


@pytest.mark.parametrize("agent_class", AGENTS, ids=lambda c: c.__name__)
async def test_agent_trains_two_steps(tool_model_dir, tmp_path, agent_class):
    await train_tool_agent_two_steps(tool_model_dir, tmp_path, agent_class)
