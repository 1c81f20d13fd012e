"""examples/two_turn.py's agents, unchanged, against a real gateway and the default model.

Each rollout is a real round trip through the controller, gateway and engine (greedy,
float32): the two-turn agent's second prompt must carry its first reply and the
follow-up, the one-turn agent must make one call, and each rollout's reward must be 1.0
exactly when its scored reply's last number is the row's answer (greedy, the model
answers both rows right, and the second row's answer is wrong on purpose, so one rollout
of each agent scores 1 and the other 0).
"""

from __future__ import annotations

import asyncio
import re

import pytest

from examples.two_turn import FOLLOW_UP, OneTurnAgent, TwoTurnAgent, final_number_reward
from looprl import startup
from looprl.scheduling.single_process import start_single_process
from tests.support.tool_model import greedy_config

# The second row's answer is wrong on purpose: 4 is the last number of the model's first
# reply to it (cut short at "First, we multiply 4 by itself, which gives us"), not of its
# second ("4 * 2 = 8"), so only a reward on the second reply scores it 0.
ROWS = [{"question": "What is 2 + 3?", "answer": 5}, {"question": "What is 4 * 2?", "answer": 4}]


def last_number_is(reply: str, answer: int) -> bool:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", reply)
    return bool(numbers) and float(numbers[-1]) == answer


@pytest.mark.parametrize(
    ("reply", "reward"),
    [
        ("The answer is 12.", 1.0),
        ("12", 1.0),
        ("-12", 0.0),
        ("12 or 13", 0.0),
        ("13, no: 12", 1.0),
        ("no number", 0.0),
        ("", 0.0),
    ],
)
def test_final_number_reward_scores_the_last_number(reply, reward):
    assert final_number_reward(reply, 12) == reward


async def run_both(model_dir) -> dict:
    cfg = greedy_config(model_dir, "sampling.max_new_tokens=32")
    async with start_single_process(startup.start(cfg, train=False), TwoTurnAgent()) as parts:
        two = await parts.controller.rollout_batch(ROWS)
        one = await parts.controller.rollout_batch(ROWS, workflow=OneTurnAgent())
    return {TwoTurnAgent: two.outcomes, OneTurnAgent: one.outcomes}


@pytest.fixture(scope="module")
def rollouts(smol_model_dir) -> dict:
    """{agent class: its rollout outcomes on ROWS, in row order}."""
    return asyncio.run(run_both(smol_model_dir))


def test_two_turn_agent_asks_for_the_number_after_its_answer(rollouts):
    for row, outcome in zip(ROWS, rollouts[TwoTurnAgent], strict=True):
        assert outcome.status == "completed", outcome.error
        first, second = outcome.calls  # exactly two calls
        assert first["messages"][-1] == {"role": "user", "content": row["question"]}
        assert second["messages"][-3:] == [
            {"role": "user", "content": row["question"]},
            {"role": "assistant", "content": first["reply"]},
            {"role": "user", "content": FOLLOW_UP},
        ]
        assert first["reply"]  # the model answered in words before the follow-up
        assert outcome.reward == (1.0 if last_number_is(second["reply"], row["answer"]) else 0.0)
        assert len(outcome.trajectories) == 1  # the second prompt extends the first
    assert [o.reward for o in rollouts[TwoTurnAgent]] == [1.0, 0.0]
    # ...though a reward on the first reply would have scored the second row 1.
    assert last_number_is(rollouts[TwoTurnAgent][1].calls[0]["reply"], ROWS[1]["answer"])


def test_one_turn_agent_asks_once(rollouts):
    for row, outcome in zip(ROWS, rollouts[OneTurnAgent], strict=True):
        assert outcome.status == "completed", outcome.error
        (call,) = outcome.calls
        assert call["messages"][-1] == {
            "role": "user",
            "content": f"{row['question']} {FOLLOW_UP}",
        }
        assert outcome.reward == (1.0 if last_number_is(call["reply"], row["answer"]) else 0.0)
    assert [o.reward for o in rollouts[OneTurnAgent]] == [1.0, 0.0]
