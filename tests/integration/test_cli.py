"""The `looprl` command, run in subprocesses from a project folder as a user runs it.

Each test starts `python -m looprl.cli` with its working directory in a fresh tmp
folder and reads what the user would read: exit codes, stdout, stderr, files written.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from looprl.config import load_config
from looprl.types import Trajectory
from tests.support.serving import free_port, running_server

ENV = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "PYTHONIOENCODING": "utf-8"}


def _looprl(*args: str, cwd: Path, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "looprl.cli", *args],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def _table(stdout: str) -> dict[str, str]:
    """The rows of a stats table printed by rich: {key: value as printed}."""
    rows = re.findall(r"^\s*[│|]\s*(\w+)\s*[│|]\s*(.*?)\s*[│|]\s*$", stdout, re.MULTILINE)
    return dict(rows)


def test_dry_run_prints_the_resolved_config(tmp_path):
    done = _looprl("train", "--dry-run", "rollout.group_size=3", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    printed = yaml.safe_load(done.stdout)
    assert printed["rollout"]["group_size"] == 3
    assert printed == load_config(None, ["rollout.group_size=3"]).model_dump(mode="json")
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing


def test_a_typo_exits_2_naming_the_field(tmp_path):
    done = _looprl("train", "rollout.grop_size=3", cwd=tmp_path)
    assert done.returncode == 2
    assert "rollout.grop_size: unknown field; did you mean 'group_size'?" in done.stderr
    assert done.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_rollout_writes_trajectories_and_prints_the_summary(tmp_path, tiny_model_dir):
    out = tmp_path / "out" / "trajectories.jsonl"
    done = _looprl(
        "rollout",
        "--rows",
        "2",
        "--out",
        str(out),
        f"model.path={tiny_model_dir}",
        "rollout.group_size=2",
        "sampling.max_new_tokens=8",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4
    for row in rows:
        assert {"input_ids", "loss_mask", "behavior_logprobs", "versions", "reward"} <= set(row)
        assert {"group_id", "text"} <= set(row)
        t = Trajectory.from_json(row)  # validates shapes and the mask
        assert 1 <= t.num_sampled_tokens <= 8
        assert t.versions[t.loss_mask].tolist() == [0] * t.num_sampled_tokens
        assert (t.behavior_logprobs[t.loss_mask] <= 0).all()
        assert row["reward"] in (0.0, 1.0)
        assert "What is" in row["text"]
    assert sorted(Counter(row["group_id"] for row in rows).values()) == [2, 2]
    summary = _table(done.stdout)
    assert "rollout summary" in done.stdout
    assert (summary["rollouts"], summary["completed"], summary["trajectories"]) == ("4", "4", "4")
    assert summary["errors"] == "-"
    assert f"wrote 4 trajectories to {out}" in done.stderr


AGENT = '''
from openai import AsyncOpenAI


class Flaky:
    """Rollout 2 raises, 4 rejects, 5 returns a string (unusable), the others score 0.5."""

    def __init__(self):
        self.calls = 0

    async def run(self, data, *, base_url, api_key, model, **kw):
        self.calls += 1
        call = self.calls
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": data["question"]}],
                max_tokens=8,
            )
        if call == 2:
            raise ValueError("the agent broke")
        return {4: None, 5: "0.5"}.get(call, 0.5)
'''


@pytest.fixture
def served(tiny_model_dir, tmp_path) -> str:
    """`looprl serve` on the tiny model; yields its /v1 URL, stops it with Ctrl-C."""
    port = free_port()
    cmd = [sys.executable, "-m", "looprl.cli", "serve", "--model", str(tiny_model_dir)]
    cmd += ["--port", str(port)]
    with running_server(cmd, port, cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL):
        yield f"http://127.0.0.1:{port}/v1"


def test_debug_workflow_reports_rewards_latency_and_errors(served, tmp_path):
    (tmp_path / "agent.py").write_text(AGENT)  # imported from the working directory
    done = _looprl(
        "debug",
        "workflow",
        "workflow.path=agent:Flaky",
        "rollout.timeout_s=60",
        "--base-url",
        served,
        "--concurrency",
        "4",
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr  # errors were found
    report = _table(done.stdout)
    assert "workflow check" in done.stdout
    assert (report["rollouts"], report["rewards"], report["returned_none"]) == ("5", "2", "1")
    assert float(report["reward_mean"]) == 0.5
    # A reward training would reject is an error here too.
    assert json.loads(report["errors"]) == {"ValueError": 1, "InvalidReward": 1}
    p50, p90, worst = (float(report[f"latency_{k}_s"]) for k in ("p50", "p90", "max"))
    assert 0 < p50 <= p90 <= worst < 60
    assert "ValueError: the agent broke" in done.stdout
    assert "'0.5' (str)" in done.stdout
