"""Rewards of the built-in RLVR workflow: the task's function, a sandboxed run of the
model's code against the row's tests, or an LLM judge (`reward.type`).

A Reward scores one rollout inside `async with reward.rollout(row) as score:` ...
`await score(prompt, completion)` (a float, or None to reject the rollout). The context
spans the whole rollout so that a group judge knows how many rollouts of a row are
still coming and can score them in one call. `take_stats()` returns the counters
(`reward_code_timeouts`, `reward_judge_failures`, ...) since its last call, for the
step's metrics record; `check_failures(max_rate, min_judgments)` raises RewardFailed
when too many of the rollouts since then could not be scored (a judge that is down),
which stops the training run; and `aclose()` releases what it holds (a judge's HTTP
client).
Knows nothing of training; `open_reward` starts what a reward needs (the judge's local
engine, on the model and precision start-up resolved) and stops it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from looprl.config import Config

if TYPE_CHECKING:
    from looprl.startup import LocalModel

Scorer = Callable[[str, str], Awaitable[float | None]]
RewardFn = Callable[..., float]  # reward_fn(prompt, completion, **row) -> float


class RewardFailed(RuntimeError):
    """The reward could not score more of a step's rollouts than reward.max_failure_rate
    allows (a judge that is down): the training run stops."""


def check_failure_rate(
    failed: int, total: int, max_rate: float, min_total: int, *, what: str, last_error: str
) -> None:
    """Raise RewardFailed when `failed` of the step's `total` scorings are more than
    `max_rate` of max(total, `min_total`): counted over at least the step's rollouts,
    so a step's first failures are not yet its whole share, while a step that never
    fills (every rollout rejected) still counts them all. `what` says who failed what,
    e.g. "the judge at URL failed {failed} of {total} judgments"."""
    if failed > max_rate * max(total, min_total):
        raise RewardFailed(
            f"{what} this step ({failed / total:.0%}), more than reward.max_failure_rate="
            f"{max_rate:g} allows; bring it back, or raise reward.max_failure_rate (1: a "
            f"failing reward never stops the run). Its last error: {last_error}"
        )


@runtime_checkable
class Reward(Protocol):
    def rollout(self, row: dict) -> AbstractAsyncContextManager[Scorer]: ...

    def take_stats(self) -> dict[str, int]: ...

    def check_failures(self, max_rate: float, min_judgments: int) -> None: ...

    async def aclose(self) -> None: ...


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

    def check_failures(self, max_rate: float, min_judgments: int) -> None:
        """A function always scores (one that raises fails its rollout, counted)."""

    async def aclose(self) -> None:
        pass

    def __repr__(self) -> str:
        fn = self.reward_fn
        return f"reward function {getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)}"


def build_reward(cfg: Config, task: Any, judge_url: tuple[str, str] | None = None) -> Reward:
    """The reward `cfg.reward.type` names for `task`. A judge without
    `reward.judge.base_url` needs `judge_url` (base URL, key) of the engine `open_reward`
    started."""
    kind = cfg.reward.type
    if kind == "function":
        if task.reward_fn is None:
            raise ValueError(
                f"task.name={cfg.task.name} has no reward function: its rows are scored by "
                f"{task.scored_by}; keep the workflow it sets, or set reward.type=code/judge"
            )
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
            "reward.type=judge without reward.judge.base_url needs the judge's endpoint "
            "from open_reward, which serves the judge model on a local engine"
        )
    model = judge.model if judge.base_url is not None else "judge"
    return JudgeReward(judge, base_url=base_url, api_key=api_key, model=model,
                       answer_field=task.answer_field)  # fmt: skip


def needs_judge_engine(cfg: Config) -> bool:
    """Whether the configured reward needs a judge served by this run: reward.type=judge
    without reward.judge.base_url."""
    return cfg.reward.type == "judge" and cfg.reward.judge.base_url is None


@contextlib.asynccontextmanager
async def open_reward(
    cfg: Config, task: Any, judge: LocalModel | None = None
) -> AsyncIterator[Reward]:
    """The configured reward, open while the context is; where it `needs_judge_engine`,
    `judge` (the judge model and the engine precision start-up resolved for it) is served
    on a local engine meanwhile."""
    async with contextlib.AsyncExitStack() as stack:
        endpoint = None
        if needs_judge_engine(cfg):
            if judge is None:
                raise ValueError(
                    "reward.type=judge without reward.judge.base_url serves the judge on a "
                    "local engine, which start-up resolves (looprl.startup); here set "
                    "reward.judge.base_url (e.g. a `looprl serve` of the judge model)"
                )
            from looprl.rewards.judge_server import serve_judge

            endpoint = await stack.enter_async_context(serve_judge(judge))
        reward = build_reward(cfg, task, endpoint)
        try:
            yield reward
        finally:
            await reward.aclose()
