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
from collections import Counter
from pathlib import Path
from typing import Any

from looprl import startup
from looprl.config import Config
from looprl.rollout.outcome import RolloutResult, check_reward, run_workflow
from looprl.scheduling.single_process import start_single_process
from looprl.tasks import load_task
from looprl.types import EpisodeReward

log = logging.getLogger(__name__)


async def collect(cfg: Config, *, rows: int, split: str, out: Path) -> RolloutResult:
    setup = startup.start(cfg, train=False)
    task = load_task(cfg.task)
    data = (task.train if split == "train" else task.eval)[:rows]
    async with (
        setup.open_workflow(task) as opened,  # a judge's engine, env workers: closed after
        start_single_process(setup, opened.workflow) as parts,
    ):
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
    setup = startup.start(cfg, train=False)
    task = load_task(cfg.task)
    async with setup.open_workflow(task) as opened:
        return await _debug(opened.workflow, task, cfg, base_url, api_key, model, concurrency)


async def _debug(
    workflow, task, cfg: Config, base_url: str, api_key: str, model: str, concurrency: int
) -> dict[str, Any]:
    rows = (task.train * (concurrency // max(len(task.train), 1) + 1))[: concurrency + 1]

    async def one(row: dict) -> tuple[float, float | None, str | None]:
        """(latency, reward, error type); a reward training would reject is an error."""
        run = await run_workflow(
            workflow,
            row,
            base_url=base_url,
            api_key=api_key,
            model=model,
            timeout_s=cfg.rollout.timeout_s,
        )
        if run.status != "completed":
            log.warning("Workflow ended with %s", run.error)
            return run.elapsed_s, None, run.error.split(":", 1)[0]
        reward, error = check_reward(run.value)
        if error:
            log.warning("Workflow result is unusable for training: %s", error)
            return run.elapsed_s, None, error.split(":", 1)[0]
        if isinstance(reward, EpisodeReward):
            reward = reward.total
        elif isinstance(reward, dict):
            reward = statistics.fmean(reward.values())
        return run.elapsed_s, reward, None

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
