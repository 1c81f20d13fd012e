"""A real two-step `looprl train` of the tiny model built to learn nothing: an agent whose
second call passes max_tokens=2 and whose reward is always 0. The run must say so from
its first step, on the `looprl` logger and as metrics records of kind "warning" (the
viewer's banner), naming the call, the limit and what to change; and no more than once
in two steps (diagnostics/learning.py)."""

from __future__ import annotations

import logging

from openai import AsyncOpenAI

from looprl.loop import train
from tests.support.tiny_run import metrics_records

CAPPED_AGENT = "tests.integration.test_learning_warnings:CappedSecondReplyAgent"


class CappedSecondReplyAgent:
    """Two calls: the first ends at a stop string (a common letter; the tiny model's
    random tokens meet one within sampling.max_new_tokens), the second is capped at two
    tokens by the agent's own max_tokens. Every rollout is rewarded 0."""

    async def run(self, data, *, base_url, api_key, model, **kw):
        async with AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
            messages = [{"role": "user", "content": data["question"]}]
            first = await client.chat.completions.create(
                model=model, messages=messages, stop=[" ", "e", "a", "o"]
            )
            messages += [
                {"role": "assistant", "content": first.choices[0].message.content or ""},
                {"role": "user", "content": "Now the answer only."},
            ]
            await client.chat.completions.create(model=model, messages=messages, max_tokens=2)
        return 0.0


async def test_a_run_that_cannot_learn_says_why_from_its_first_step(tiny_run, caplog):
    cfg = tiny_run(
        f"workflow.path={CAPPED_AGENT}",
        "rollout.batch_size=2",
        "rollout.group_size=4",
        "sampling.max_new_tokens=24",
        "eval.size=2",
    )
    with caplog.at_level(logging.WARNING, logger="looprl"):
        await train(cfg, show_progress=False)

    warnings = metrics_records(cfg.run_dir, "warning")
    assert sorted((w["step"], w["name"]) for w in warnings) == [
        (1, "equal_rewards"),
        (1, "truncated"),
    ]
    by_name = {w["name"]: w["message"] for w in warnings}
    truncated = by_name["truncated"]
    assert truncated.startswith("Step 1: 100% of the rollouts' 2nd model calls (8 of 8)")
    assert "max_tokens=2, which the agent's request passed" in truncated
    assert "raise the max_tokens the agent passes" in truncated
    assert by_name["equal_rewards"].startswith("Step 1: 100% of the groups got the same reward")
    for message in by_name.values():
        assert message in caplog.text

    (step,) = [r for r in metrics_records(cfg.run_dir, "train") if r["step"] == 1]
    assert step["truncated_turn"] == 2 and step["truncated_turn_max_tokens"] == 2
    assert step["truncated_turn_requested_max_tokens"] == 2
    assert step["degenerate_group_share"] == 1.0
