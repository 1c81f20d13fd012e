"""`workflow.mode=subprocess`: agents as real child processes, reward posted over HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from looprl import startup
from looprl.config import ConfigError, load_config
from looprl.config.workflow import AGENT_VARIABLES
from looprl.scheduling.single_process import start_single_process
from looprl.tasks import load_task
from looprl.workflows.agent_process import (
    INHERITED,
    STDERR_TAIL_BYTES,
    AgentProcess,
    AgentProcessError,
)
from looprl.workflows.resolution import configured_workflow
from tests.support.tool_model import greedy_config

ROW = {"question": "What is 2 + 3?", "answer": 5}
REPO = Path(__file__).resolve().parents[2]
# What run() gets from the controller for a session; nothing listens there in the tests
# that call run() directly.
SESSION = {
    "base_url": "http://127.0.0.1:9/sessions/s1/v1",
    "api_key": "model-call-key",
    "model": "policy",
    "reward_key": "reward-key",
}


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def _python(code: str, *args: str) -> list[str]:
    return [sys.executable, "-c", code, *args]


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


# ---- what the agent gets of looprl's environment ------------------------------------


async def test_the_agent_gets_its_session_and_only_the_variables_it_is_given(tmp_path, monkeypatch):
    """The trainer's secrets stay out (a tracker key, any other variable), the names in
    workflow.env_passthrough come in, and OPENAI_API_KEY is the session's, not looprl's."""
    monkeypatch.setenv("LOOPRL_TEST_SECRET", "trainer-only")
    monkeypatch.setenv("WANDB_API_KEY", "trainer-wandb-key")
    monkeypatch.setenv("OPENAI_API_KEY", "trainer-openai-key")
    monkeypatch.setenv("MY_TOOL_KEY", "for-the-agent")
    monkeypatch.setenv("LC_TIME", "C")
    dump = tmp_path / "env.json"
    write_env = "import json, os, sys; open(sys.argv[1], 'w').write(json.dumps(dict(os.environ)))"
    agent = AgentProcess(
        _python(write_env, str(dump)), env={"MINE": "1"}, env_passthrough=["MY_TOOL_KEY"]
    )
    assert await agent.run(ROW, **SESSION) is None
    env = json.loads(dump.read_text())
    assert "LOOPRL_TEST_SECRET" not in env and "WANDB_API_KEY" not in env
    assert env["MY_TOOL_KEY"] == "for-the-agent" and env["MINE"] == "1"
    assert env["LC_TIME"] == "C" and env["PATH"] == os.environ["PATH"]
    assert env["OPENAI_API_KEY"] == "model-call-key" and env["LOOPRL_REWARD_KEY"] == "reward-key"
    assert env["LOOPRL_REWARD_URL"] == "http://127.0.0.1:9/sessions/s1/reward"
    assert json.loads(env["LOOPRL_DATA"]) == ROW
    inherited = {name for name in INHERITED if name in os.environ}
    expected = inherited | {"MY_TOOL_KEY", "MINE", *AGENT_VARIABLES}
    # LC_*: looprl's, and the one Python itself may set (LC_CTYPE, PEP 538)
    assert {n for n in env if not n.startswith("LC_")} == expected

    # without a session (looprl debug workflow against another server): no reward to post
    no_reward = {**SESSION, "reward_key": None}
    assert await agent.run(ROW, **no_reward) is None
    env = json.loads(dump.read_text())
    assert "LOOPRL_REWARD_URL" not in env and "LOOPRL_REWARD_KEY" not in env


def test_a_name_to_pass_through_that_is_not_set_is_left_out_and_said(monkeypatch, caplog):
    monkeypatch.delenv("LOOPRL_TEST_UNSET", raising=False)
    agent = AgentProcess(["true"], env_passthrough=["LOOPRL_TEST_UNSET"])
    assert "LOOPRL_TEST_UNSET, not set in looprl's environment" in caplog.text
    assert "LOOPRL_TEST_UNSET" not in agent.inherited_env()


# ---- its stderr, and what it leaves behind ------------------------------------------


async def test_an_agent_flooding_stderr_keeps_only_the_tail_in_memory():
    flood = (
        "import sys; sys.stderr.buffer.write(b'x' * (10 << 20)); "
        "sys.stderr.write('\\nthe last line\\n'); sys.exit(2)"
    )
    agent = AgentProcess(_python(flood))
    tracemalloc.start()
    try:
        with pytest.raises(AgentProcessError, match="exited with code 2") as failed:
            await agent.run(ROW, **SESSION)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, f"{peak} bytes held for 10 MiB of stderr"
    message = str(failed.value)
    assert message.endswith(
        "its stderr ends with:\n" + "x" * (STDERR_TAIL_BYTES - 15) + "\nthe last line"
    )


async def test_what_an_agent_leaves_running_is_killed_when_it_exits(tmp_path):
    """A child in the agent's process group dies with it (and holding the agent's stderr
    does not hold the rollout); one that left the group with setsid escapes the kill,
    and still does not hold the rollout past the grace period."""
    left, escaped = tmp_path / "left", tmp_path / "escaped"
    leaves = (
        "import subprocess, sys; "
        "child = subprocess.Popen(['sleep', '1000']); "
        "open(sys.argv[1], 'w').write(str(child.pid)); "
        "runaway = subprocess.Popen(['sleep', '1000'], start_new_session=True); "
        "open(sys.argv[2], 'w').write(str(runaway.pid))"
    )
    agent = AgentProcess(_python(leaves, str(left), str(escaped)), kill_grace_s=0.5)
    start = time.monotonic()
    try:
        assert await agent.run(ROW, **SESSION) is None
        assert time.monotonic() - start < 5
        assert not _alive(int(left.read_text())), "a child outlived its agent"
        assert _alive(int(escaped.read_text()))  # what a process-group kill cannot reach
    finally:
        os.kill(int(escaped.read_text()), signal.SIGKILL)


async def test_a_cancelled_agent_and_its_children_are_killed(tmp_path):
    """The run stopping (or a rollout's timeout) cancels run(): the agent, which ignores
    SIGTERM, and its child are both gone after the grace period."""
    pids = tmp_path / "pids"
    stubborn = (
        "import os, signal, subprocess, sys, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "child = subprocess.Popen(['sleep', '1000']); "
        "open(sys.argv[1], 'w').write(f'{os.getpid()} {child.pid}'); time.sleep(1000)"
    )
    agent = AgentProcess(_python(stubborn, str(pids)), kill_grace_s=0.5)
    task = asyncio.ensure_future(agent.run(ROW, **SESSION))
    while not pids.exists() or not pids.read_text():
        await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not any(_alive(int(pid)) for pid in pids.read_text().split())


# ---- config ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["workflow.mode=subprocess"], "needs workflow.command"),
        (["workflow.command=./agent"], "only run with workflow.mode=subprocess"),
        (["workflow.mode=subprocess", "workflow.command=a", "workflow.path=x:Y"], "not used"),
        (["workflow.env_passthrough=[E2B_API_KEY]"], "only used with workflow.mode=subprocess"),
        (
            ["workflow.mode=subprocess", "workflow.command=a", "workflow.env_passthrough=[A-B]"],
            "'A-B' is not an environment variable name",
        ),
        (
            [
                "workflow.mode=subprocess",
                "workflow.command=a",
                "workflow.env_passthrough=[OPENAI_API_KEY]",
            ],
            "OPENAI_API_KEY is set by looprl for each rollout",
        ),
    ],
)
def test_subprocess_mode_needs_a_command_and_no_path(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_subprocess_config_reloads_from_the_run_dir(tmp_path):
    cfg = load_config(
        None,
        [
            "workflow.mode=subprocess",
            "workflow.command=python a.py",
            "workflow.env_passthrough=[E2B_API_KEY]",
            f"run.fileroot={tmp_path}",
        ],
    )
    assert load_config(str(cfg.save()), []) == cfg
    assert configured_workflow(cfg, None).env_passthrough == ["E2B_API_KEY"]
