"""Asynchronous rollouts under the staleness manager, through the real gateway and engine.

Each test drives `start_single_process` (tiny model, real HTTP gateway, real controller) the way
the training loop does: take a batch, "train" (here: a weight update to the engine with
the next version), tell the controller, repeat.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from looprl import startup
from looprl.models import load_model
from looprl.scheduling.single_process import start_single_process
from tests.support.rollouts import (
    QUESTION,
    Counting,
    groups_of,
    openai_client,
    repeat_row,
    rollout_config,
)


class SampleThenThink:
    """Samples first, then thinks `row["think_s"]` seconds before scoring: the tokens of a
    slow rollout age while faster rollouts are trained on. Tracks concurrency."""

    def __init__(self) -> None:
        self.running = self.peak = 0

    async def run(self, data: dict, *, base_url: str, api_key: str, model: str, **kw: Any):
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            async with openai_client(base_url, api_key) as client:
                await client.chat.completions.create(model=model, messages=QUESTION, max_tokens=3)
            await asyncio.sleep(data["think_s"])
            return 1.0
        finally:
            self.running -= 1


async def _train_step(parts, weights) -> None:
    """What the loop does after a batch: train (here: 0.3 s during which the rollouts
    admitted ahead go on, as on a remote engine), then new weights at the next version."""
    await asyncio.sleep(0.3)
    await parts.engine.update_weights(weights, parts.engine.version + 1)
    parts.controller.notify_version()


async def test_slow_and_fast_workflows_never_train_on_stale_data(tiny_model_dir):
    cfg = rollout_config(
        tiny_model_dir,
        "rollout.group_size=2",
        "rollout.batch_size=2",
        "rollout.max_head_offpolicyness=1",
        "rollout.max_concurrent_rollouts=6",
    )
    workflow = SampleThenThink()
    rows = itertools.cycle([{"think_s": 1.5}] + [{"think_s": 0.02}] * 3)
    weights = load_model(tiny_model_dir).state_dict()
    staleness, dropped = [], 0
    async with start_single_process(startup.start(cfg, train=False), workflow) as parts:
        for _ in range(6):
            result = await parts.controller.prepare_batch(rows)
            assert len(groups_of(result)) == 2
            version = parts.engine.version  # the version this batch is trained at
            staleness += [version - t.oldest_version() for t in result.trajectories]
            dropped += result.stats()["dropped_stale_groups"]
            await _train_step(parts, weights)
    assert max(staleness) <= 1  # the bound holds for every trajectory trained on
    assert 1 in staleness  # and rollouts did run ahead of the trainer
    # The slow groups sampled at an old version came back 2+ versions behind: left out.
    assert dropped >= 1
    assert 2 < workflow.peak <= 6  # overlapped, never past max_concurrent_rollouts


# Synchronous, 2 groups of 2 per version, warning after 0.3 s of blocked admission.
BLOCKS_FAST = ("rollout.group_size=2", "rollout.batch_size=2", "rollout.blocked_warning_s=0.3")


def _blocked_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "Rollout admission" in r.getMessage()]


async def test_blocked_admission_is_explained_once(tiny_model_dir, caplog):
    """The classic trap: asking for the next batch before the version advanced."""
    cfg = rollout_config(tiny_model_dir, *BLOCKS_FAST)
    rows = repeat_row(q=1)
    async with start_single_process(startup.start(cfg, train=False), Counting()) as parts:
        controller = parts.controller
        await controller.prepare_batch(rows)
        with caplog.at_level(logging.WARNING, logger="looprl.rollout.controller"):
            for _ in range(2):  # synchronous RL: nothing more starts at version 0
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(controller.prepare_batch(rows), 1.0)

    warnings = _blocked_warnings(caplog)
    assert len(warnings) == 1, warnings  # once, not once per blocked call
    message = warnings[0]
    assert "it waits for 2 more group(s) and 0 are running" in message
    assert "min(64 - 0, (0 + 0 + 1) * 4 - (4 + 0)) = min(64, 0) = 0 < 2" in message
    assert "rollout.batch_size=2 x group_size=2" in message
    assert "Raise rollout.max_head_offpolicyness (now 0)" in message
    assert "controller.notify_version()" in message
    assert "Nothing is running, so this will not unblock by itself." in message


async def test_a_batch_too_big_for_one_version_is_explained_and_loses_nothing(
    tiny_model_dir, caplog
):
    cfg = rollout_config(tiny_model_dir, *BLOCKS_FAST)
    rows = repeat_row(q=1)
    async with start_single_process(startup.start(cfg, train=False), Counting()) as parts:
        controller = parts.controller
        # Synchronous RL admits 2 groups per version: a batch of 3 can never fill.
        with (
            caplog.at_level(logging.WARNING, logger="looprl.rollout.controller"),
            pytest.raises(TimeoutError),
        ):
            await asyncio.wait_for(controller.prepare_batch(rows, batch_size=3), 3.0)
        # The two groups that did finish were not lost with the cancelled call.
        batch = await asyncio.wait_for(controller.prepare_batch(rows), 1.0)
        assert len(groups_of(batch)) == 2
    (message,) = _blocked_warnings(caplog)
    assert "prepare_batch asked for 3 groups" in message
    assert "ask for at most rollout.batch_size=2" in message


class HalfEqual:
    """Even rows: both rollouts score 1 (all equal). Odd rows: the first 1, the next 0."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}

    async def run(self, data: dict, *, base_url: str, api_key: str, model: str, **kw: Any):
        async with openai_client(base_url, api_key) as client:
            await client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2)
        if data["id"] % 2 == 0:
            return 1.0
        self.seen[data["id"]] = self.seen.get(data["id"], 0) + 1
        return float(self.seen[data["id"]] == 1)


def _numbered_rows() -> Iterator[dict]:
    return ({"id": i} for i in itertools.count())


@pytest.mark.parametrize("filtering", [True, False])
async def test_dynamic_filtering_keeps_sampling_until_the_batch_is_full(tiny_model_dir, filtering):
    cfg = rollout_config(
        tiny_model_dir,
        "rollout.group_size=2",
        "rollout.batch_size=2",
        f"rollout.dynamic_filtering={str(filtering).lower()}",
    )
    async with start_single_process(startup.start(cfg, train=False), HalfEqual()) as parts:
        result = await parts.controller.prepare_batch(_numbered_rows())
        staleness = parts.controller.staleness
    groups: dict[str, list[float]] = {}
    for outcome in result.outcomes:
        groups.setdefault(outcome.group_id, []).append(outcome.reward)
    rewards = sorted(sorted(r) for r in groups.values())
    if filtering:
        # Rows 0 and 2 (all rewards 1) were sampled, left out, and replaced by rows 1 and 3.
        assert rewards == [[0.0, 1.0], [0.0, 1.0]]
        assert result.stats()["filtered_groups"] == 2
        assert (staleness.accepted, staleness.rejected) == (4, 4)
    else:
        assert rewards == [[0.0, 1.0], [1.0, 1.0]]
        assert result.stats()["filtered_groups"] == 0


class AddsBonus:
    """A workflow class built with kwargs: one model call, reward row["reward"] + bonus."""

    def __init__(self, bonus: float, think_s: float = 0.0) -> None:
        self.bonus, self.think_s = bonus, think_s

    async def run(self, data: dict, *, base_url: str, api_key: str, model: str, **kw: Any):
        async with openai_client(base_url, api_key) as client:
            await client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2)
        await asyncio.sleep(self.think_s)
        return data["reward"] + self.bonus


async def test_submit_wait_and_rollout_batch_take_another_workflow(tiny_model_dir):
    cfg = rollout_config(tiny_model_dir, "rollout.group_size=2")
    async with start_single_process(startup.start(cfg, train=False), Counting()) as parts:
        controller = parts.controller
        with pytest.raises(RuntimeError, match="nothing is submitted or running"):
            await controller.wait(1)

        controller.submit({"reward": 0.5}, workflow=AddsBonus, workflow_kwargs={"bonus": 0.25})
        controller.submit(
            {"reward": 1.0}, workflow=AddsBonus, workflow_kwargs={"bonus": 0.0}, group_size=3
        )
        result = await controller.wait(2)
        by_group: dict[str, list[float]] = {}
        for outcome in result.outcomes:
            by_group.setdefault(outcome.group_id, []).append(outcome.reward)
        assert sorted(by_group.values()) == [[0.75, 0.75], [1.0, 1.0, 1.0]]

        controller.submit({"reward": 0.0}, workflow=AddsBonus(0.0, think_s=1.0))
        with pytest.raises(TimeoutError, match="0 of 1 groups after 0.2 s"):
            await controller.wait(1, timeout=0.2)
        assert len((await controller.wait(1)).outcomes) == 2  # it was still coming

        offline = await controller.rollout_batch(
            [{"reward": 0.5}],
            workflow="tests.integration.test_async_rollout:AddsBonus",
            workflow_kwargs={"bonus": 0.5},
        )
        assert [o.reward for o in offline.outcomes] == [1.0, 1.0]

        with pytest.raises(ValueError, match="max_concurrent_rollouts=64"):
            controller.submit({}, group_size=65)
        with pytest.raises(ValueError, match="without a workflow"):
            controller.submit({}, workflow_kwargs={"bonus": 1.0})
