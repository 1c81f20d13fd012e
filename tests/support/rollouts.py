"""What the rollout tests (tests/integration/test_rollout.py, test_async_rollout.py)
share: a rollout config of the tiny model, a client on the controller's base_url, rows,
a counting workflow, and a result's trajectories by group."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

from openai import AsyncOpenAI

from looprl.config import Config, load_config
from looprl.rollout.outcome import RolloutResult
from looprl.types import Trajectory

QUESTION = [{"role": "user", "content": "Is it five?"}]


def rollout_config(model_dir, *overrides: str) -> Config:
    """Rollouts of 4 tokens, groups of 1, on `model_dir`; `overrides` win."""
    base = [f"model.path={model_dir}", "sampling.max_new_tokens=4", "rollout.group_size=1"]
    return load_config(None, [*base, *overrides])


def openai_client(base_url: str, api_key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)


def repeat_row(**row: Any) -> Iterator[dict]:
    """`row`, endlessly."""
    return itertools.repeat(row)


def groups_of(result: RolloutResult) -> list[list[Trajectory]]:
    """`result`'s trajectories, by group, groups in order of first appearance."""
    by_group: dict[str, list[Trajectory]] = {}
    for t in result.trajectories:
        by_group.setdefault(t.group_id, []).append(t)
    return list(by_group.values())


class Counting:
    """One short model call; counts rollouts started and the most running at once."""

    def __init__(self) -> None:
        self.started = self.running = self.peak = 0

    async def run(self, data: dict, *, base_url: str, api_key: str, model: str, **kw: Any):
        self.started += 1
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            async with openai_client(base_url, api_key) as client:
                await client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2)
            await asyncio.sleep(0.05)
            return 1.0
        finally:
            self.running -= 1
