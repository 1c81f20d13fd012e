"""Which workflow a config names, and opening it with its reward for a command.

`configured_workflow` builds the workflow `cfg.workflow` names, filling in what the
built-in ones take from other sections (the reward, the task's prompt field, the env
section, the run's frames folder). `open_workflow` is the one way a command gets a
workflow: the reward opened first (the judge's engine started where it needs one), the
workflow built on it, and on exit the workflow closed (`close_workflow`: an
EnvWorkflow's worker processes stop), then the reward. `OpenedWorkflow.checking_reward`
waits for a batch while checking that the reward can still score it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from looprl.config import ENV_WORKFLOW, VERIFIERS_WORKFLOW, Config
from looprl.rewards import Reward, build_reward, open_reward
from looprl.workflows.agent_process import AgentProcess
from looprl.workflows.protocol import Workflow, close_workflow, resolve_workflow

if TYPE_CHECKING:
    from looprl.startup import LocalModel

RLVR_WORKFLOW = "looprl.workflows:RLVRWorkflow"
REWARD_CHECK_EVERY_S = 1.0  # how often a batch being filled checks the reward's failures

T = TypeVar("T")


@dataclass(frozen=True)
class OpenedWorkflow:
    """A command's workflow and, for the built-in RLVR workflow, the reward it was built
    on (None for a workflow that scores its rollouts itself), both open."""

    workflow: Workflow
    reward: Reward | None

    def reward_stats(self) -> dict[str, int]:
        """The reward's counters since the last call (none without a reward)."""
        return {} if self.reward is None else self.reward.take_stats()

    async def checking_reward(
        self, batch: Awaitable[T], max_failure_rate: float, min_judgments: int
    ) -> T:
        """`batch` (a step's rollouts being collected), with the reward's
        `check_failures(max_failure_rate, min_judgments)` every REWARD_CHECK_EVERY_S and
        once it is in (before `reward_stats` starts the next count). A judge that is
        down rejects every rollout, so the batch would never fill: its RewardFailed
        cancels the batch and stops the run instead."""
        if self.reward is None:
            return await batch
        task = asyncio.ensure_future(batch)
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=REWARD_CHECK_EVERY_S)
                self.reward.check_failures(max_failure_rate, min_judgments)
        finally:
            task.cancel()  # still filling: the reward failed, or this wait was cancelled
        return task.result()


def uses_configured_reward(cfg: Config) -> bool:
    """Whether the configured workflow is scored by `reward.*`: the built-in RLVR
    workflow without a reward_fn of its own in workflow.kwargs."""
    workflow = cfg.workflow
    return (
        workflow.mode == "python"
        and workflow.path == RLVR_WORKFLOW
        and "reward_fn" not in workflow.kwargs
    )


@asynccontextmanager
async def open_workflow(
    cfg: Config, task: Any, *, frames_dir: Path, judge: LocalModel | None = None
) -> AsyncIterator[OpenedWorkflow]:
    """The configured workflow, on the configured reward where it `uses_configured_reward`
    (with `judge` served where that needs a local engine); closes the workflow, then the
    reward, on exit."""
    async with contextlib.AsyncExitStack() as stack:
        reward = None
        if uses_configured_reward(cfg):
            reward = await stack.enter_async_context(open_reward(cfg, task, judge))
        workflow = configured_workflow(cfg, task, reward, frames_dir=frames_dir)
        try:
            yield OpenedWorkflow(workflow, reward)
        finally:
            await close_workflow(workflow)


def configured_workflow(
    cfg: Config, task: Any, reward: Reward | None = None, *, frames_dir: Path | None = None
) -> Workflow:
    """The workflow `cfg.workflow` names: a program per rollout (subprocess mode), or
    the object at workflow.path; the built-in RLVRWorkflow gets `reward` (else the one
    `reward.type` names for `task`), the task's prompt field and system prompt unless
    workflow.kwargs set them; looprl.workflows:EnvWorkflow gets the env section and
    `frames_dir` (where env.frames_every saves frames), and looprl.workflows:VerifiersWorkflow the
    verifiers environment task.dataset names."""
    kwargs = dict(cfg.workflow.kwargs)
    if cfg.workflow.mode == "subprocess":
        return AgentProcess(
            cfg.workflow.command, env_passthrough=cfg.workflow.env_passthrough, **kwargs
        )
    if cfg.workflow.path == RLVR_WORKFLOW:
        if "reward_fn" not in kwargs:
            kwargs["reward_fn"] = reward or build_reward(cfg, task)
        kwargs.setdefault("prompt_field", task.prompt_field)
        kwargs.setdefault("system_prompt", task.system_prompt)
    if cfg.workflow.path == ENV_WORKFLOW:  # the env section, unless workflow.kwargs say
        frames = None if frames_dir is None else str(frames_dir)
        kwargs = {**cfg.env.model_dump(), "frames_dir": frames, **kwargs}
    if cfg.workflow.path == VERIFIERS_WORKFLOW:
        kwargs = {"env_id": cfg.task.dataset, "env_kwargs": cfg.task.dataset_kwargs, **kwargs}
    return resolve_workflow(cfg.workflow.path, kwargs)
