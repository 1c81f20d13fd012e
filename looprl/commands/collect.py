"""Running a workflow without training: collecting trajectories, checking an agent.

Owns `collect` (the workflow over dataset rows on the local engine and gateway,
trajectories written as JSONL: `looprl rollout`) and `debug_workflow` (the workflow
against any OpenAI-compatible server: one row, then N concurrent, with latency
percentiles and errors by type: `looprl debug workflow`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

from looprl.agent_process import AgentProcess
from looprl.config import Config
from looprl.rollout.controller import RolloutResult, check_reward
from looprl.scheduling.single_process import launch_local
from looprl.tasks import load_task
from looprl.workflow import resolve_workflow

log = logging.getLogger(__name__)


def workflow_for(cfg: Config, task) -> Any:
    """The configured workflow; the built-in RLVR workflow gets the task's reward."""
    kwargs = dict(cfg.workflow.kwargs)
    if cfg.workflow.mode == "subprocess":
        return AgentProcess(cfg.workflow.command, **kwargs)
    if cfg.workflow.path == "looprl.workflow:RLVRWorkflow":
        kwargs.setdefault("reward_fn", task.reward_fn)
        kwargs.setdefault("prompt_field", task.prompt_field)
        kwargs.setdefault("system_prompt", task.system_prompt)
    return resolve_workflow(cfg.workflow.path, kwargs)


async def collect(cfg: Config, *, rows: int, split: str, out: Path) -> RolloutResult:
    task = load_task(cfg.task)
    data = (task.train if split == "train" else task.eval)[:rows]
    workflow = workflow_for(cfg, task)
    async with launch_local(cfg, workflow) as parts:
        total = len(data) * cfg.rollout.group_size
        done = Counter()

        def progress(outcome) -> None:
            done[outcome.status] += 1
            if sum(done.values()) % max(total // 10, 1) == 0:
                log.info("Rollouts finished: %d of %d (%s)", sum(done.values()), total, dict(done))

        log.info(
            "Running %d rows x %d rollouts on %s",
            len(data),
            cfg.rollout.group_size,
            parts.gateway.url,
        )
        result = await parts.controller.rollout_batch(data, on_done=progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for traj in result.trajectories:
            f.write(json.dumps(traj.to_json()) + "\n")
    return result


async def debug_workflow(
    cfg: Config, *, base_url: str, api_key: str, model: str, concurrency: int
) -> dict[str, Any]:
    task = load_task(cfg.task)
    workflow = workflow_for(cfg, task)
    rows = (task.train * (concurrency // max(len(task.train), 1) + 1))[: concurrency + 1]

    async def one(row: dict) -> tuple[float, float | None, str | None]:
        """(latency, reward, error type); a reward training would reject is an error."""
        start = time.monotonic()
        try:
            result = await asyncio.wait_for(
                workflow.run(row, base_url=base_url, api_key=api_key, model=model),
                timeout=cfg.rollout.timeout_s,
            )
        except TimeoutError:
            return time.monotonic() - start, None, "TimeoutError"
        except Exception as e:
            log.warning("Workflow raised %s: %s", type(e).__name__, e)
            return time.monotonic() - start, None, type(e).__name__
        reward, error = check_reward(result)
        if error:
            log.warning("Workflow result is unusable for training: %s", error)
            return time.monotonic() - start, None, error.split(":", 1)[0]
        if isinstance(reward, dict):
            reward = statistics.fmean(reward.values())
        return time.monotonic() - start, reward, None

    log.info("One rollout first, against %s", base_url)
    first = await one(rows[0])
    log.info(
        "First rollout: reward %r in %.2f s%s",
        first[1],
        first[0],
        f", error {first[2]}" if first[2] else "",
    )
    log.info("Now %d concurrent rollouts", concurrency)
    results = [first, *await asyncio.gather(*(one(r) for r in rows[1:]))]
    latencies = sorted(r[0] for r in results)
    rewards = [r[1] for r in results if r[1] is not None]

    def pct(p: float) -> float:
        return latencies[min(int(p * len(latencies)), len(latencies) - 1)]

    return {
        "rollouts": len(results),
        "rewards": len(rewards),
        "reward_mean": statistics.fmean(rewards) if rewards else float("nan"),
        "returned_none": sum(r[1] is None and r[2] is None for r in results),
        "latency_p50_s": pct(0.5),
        "latency_p90_s": pct(0.9),
        "latency_max_s": latencies[-1],
        "errors": dict(Counter(r[2] for r in results if r[2])),
    }
