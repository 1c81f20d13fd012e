"""Running a workflow without training: `collect`, the workflow over dataset rows on the
local engine and gateway, trajectories written as JSONL (`looprl rollout`). Checking an
agent (`looprl debug workflow`) is workflow_check.py.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

from looprl import startup
from looprl.config import Config
from looprl.rollout.outcome import RolloutResult
from looprl.scheduling.single_process import start_single_process
from looprl.tasks import load_task

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
