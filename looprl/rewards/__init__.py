"""Rewards of the built-in RLVR workflow: the task's function, a sandboxed run of the
model's code against the row's tests, or an LLM judge (`reward.type`).

A Reward scores one rollout inside `async with reward.rollout(row) as score:` ...
`await score(prompt, completion)` (a float, or None to reject the rollout). The context
spans the whole rollout so that a group judge knows how many rollouts of a row are
still coming and can score them in one call. `take_stats()` returns the counters
(`reward_code_timeouts`, `reward_judge_failures`, ...) since its last call, for the
step's metrics record. Knows nothing of training; `open_reward` starts what a reward
needs (the judge's local engine) and stops it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, runtime_checkable

from looprl.config import Config

Scorer = Callable[[str, str], Awaitable[float | None]]


@runtime_checkable
class Reward(Protocol):
    def rollout(self, row: dict) -> AbstractAsyncContextManager[Scorer]: ...

    def take_stats(self) -> dict[str, int]: ...


class FunctionReward:
    """A plain `reward_fn(prompt, completion, **row) -> float` (task.reward)."""

    def __init__(self, reward_fn: Callable[..., float]):
        self.reward_fn = reward_fn

    @contextlib.asynccontextmanager
    async def rollout(self, row: dict) -> AsyncIterator[Scorer]:
        async def score(prompt: str, completion: str) -> float:
            return float(self.reward_fn(prompt, completion, **row))

        yield score

    def take_stats(self) -> dict[str, int]:
        return {}

    def __repr__(self) -> str:
        fn = self.reward_fn
        return f"reward function {getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)}"


def build_reward(cfg: Config, task: Any, judge_url: tuple[str, str] | None = None) -> Reward:
    """The reward `cfg.reward.type` names for `task`. A judge without
    `reward.judge.base_url` needs `judge_url` (base URL, key) of the engine `open_reward`
    started."""
    kind = cfg.reward.type
    if kind == "function":
        return FunctionReward(task.reward_fn)
    if kind == "code":
        from looprl.rewards.code import CodeReward

        return CodeReward(cfg.reward.code)
    from looprl.rewards.judge import JudgeReward, remote_endpoint

    judge = cfg.reward.judge
    if judge.base_url is not None:
        base_url, api_key = remote_endpoint(judge)
    elif judge_url is not None:
        base_url, api_key = judge_url
    else:
        raise ValueError(
            "reward.type=judge without reward.judge.base_url serves the judge on a local "
            "engine, which `looprl train` starts; here set reward.judge.base_url (e.g. a "
            "`looprl serve` of the judge model)"
        )
    model = judge.model if judge.base_url is not None else "judge"
    return JudgeReward(judge, base_url=base_url, api_key=api_key, model=model,
                       answer_field=task.answer_field)  # fmt: skip


@contextlib.asynccontextmanager
async def open_reward(cfg: Config, task: Any) -> AsyncIterator[Reward]:
    """The configured reward, with the judge's local engine running while it is open."""
    judge = cfg.reward.judge
    if cfg.reward.type != "judge" or judge.base_url is not None:
        reward = build_reward(cfg, task)
        try:
            yield reward
        finally:
            await _close(reward)
        return
    from looprl.rewards.judge_server import serve_judge

    async with serve_judge(judge.model) as endpoint:
        reward = build_reward(cfg, task, endpoint)
        try:
            yield reward
        finally:
            await _close(reward)


async def _close(reward: Reward) -> None:
    from looprl.rewards.judge import JudgeReward

    if isinstance(reward, JudgeReward):
        await reward.close()
