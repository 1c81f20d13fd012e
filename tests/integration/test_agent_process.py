"""`workflow.mode=subprocess`: agents as real child processes, reward posted over HTTP."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from looprl import startup
from looprl.config import ConfigError, load_config
from looprl.scheduling.single_process import start_single_process
from looprl.tasks import load_task
from looprl.workflows.agent_process import AgentProcess
from looprl.workflows.resolution import configured_workflow
from tests.support.tool_model import greedy_config

ROW = {"question": "What is 2 + 3?", "answer": 5}
REPO = Path(__file__).resolve().parents[2]


async def test_a_program_agent_posts_its_reward_and_trains_as_one_sample(tool_model_dir):
    cfg = greedy_config(
        tool_model_dir,
        "workflow.mode=subprocess",
        f"workflow.command=[{sys.executable}, -m, examples.calculator.agent_cli]",
        f"workflow.kwargs={{cwd: {REPO}}}",
    )
    agent = configured_workflow(cfg, load_task(cfg.task))
    assert isinstance(agent, AgentProcess)
    async with start_single_process(startup.start(cfg, train=False), agent) as parts:
        result = await parts.controller.rollout_batch([ROW])
    stats = result.stats()
    assert stats["completed"] == 1 and stats["reward_mean"] == 1.0, stats
    assert stats["calls"] == 2 and stats["concat_breaks"] == 0
    assert len(result.trajectories) == 1


async def test_a_hanging_agent_is_killed_at_the_timeout_and_counted(tiny_model_dir, tmp_path):
    pid_file = tmp_path / "pid"
    hang = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    agent = AgentProcess([sys.executable, "-c", hang], kill_grace_s=1)
    cfg = greedy_config(tiny_model_dir, "rollout.timeout_s=3")
    start = time.monotonic()
    async with start_single_process(startup.start(cfg, train=False), agent) as parts:
        result = await parts.controller.rollout_batch([ROW])
    assert time.monotonic() - start < 3 + 10
    stats = result.stats()
    assert stats["timed_out"] == 1 and stats["errors"] == {"TimeoutError": 1}, stats
    pid = int(pid_file.read_text())
    assert not Path(f"/proc/{pid}").exists(), "the agent outlived its rollout"


async def test_an_agent_that_exits_non_zero_is_counted_with_its_stderr(tiny_model_dir):
    crash = "import sys; print('starting'); print('KeyError: tool', file=sys.stderr); sys.exit(3)"
    agent = AgentProcess([sys.executable, "-c", crash])
    async with start_single_process(
        startup.start(greedy_config(tiny_model_dir), train=False), agent
    ) as parts:
        result = await parts.controller.rollout_batch([ROW])
    stats = result.stats()
    assert stats["failed"] == 1 and stats["errors"] == {"AgentProcessError": 1}, stats
    (outcome,) = result.outcomes + result.left_out
    assert "exited with code 3" in outcome.error
    assert outcome.error.endswith("its stderr ends with:\nKeyError: tool")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["workflow.mode=subprocess"], "needs workflow.command"),
        (["workflow.command=./agent"], "only run with workflow.mode=subprocess"),
        (["workflow.mode=subprocess", "workflow.command=a", "workflow.path=x:Y"], "not used"),
    ],
)
def test_subprocess_mode_needs_a_command_and_no_path(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_subprocess_config_reloads_from_the_run_dir(tmp_path):
    cfg = load_config(
        None,
        ["workflow.mode=subprocess", "workflow.command=python a.py", f"run.fileroot={tmp_path}"],
    )
    assert load_config(str(cfg.save()), []) == cfg
