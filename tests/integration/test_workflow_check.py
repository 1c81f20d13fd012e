"""`looprl debug workflow` (looprl/commands/workflow_check.py), run as a user runs it: a
subprocess in a project folder holding their agent module, on the tiny model, with no
server given (the engine starts in the command) or a --base-url where nothing listens.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.serving import free_port
from tests.support.tiny_run import tiny_run_overrides

# A new user's agent module, written as the docs show: the openai client on the
# base_url and api_key it is given.
AGENT = """\
import json
from pathlib import Path

from openai import AsyncOpenAI


async def ask(question, base_url, api_key, model):
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        reply = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], max_tokens=4
        )
    return reply.choices[0].message.content


class Answers:
    async def run(self, data, *, base_url, api_key, model, **kw):
        text = await ask(data["question"], base_url, api_key, model)
        with Path("replies.jsonl").open("a") as f:
            f.write(json.dumps(text) + "\\n")
        return 1.0


class Raises:
    async def run(self, data, *, base_url, api_key, model, **kw):
        await ask(data["question"], base_url, api_key, model)
        return float(data["missing_key"])  # the line a user must see


class NoCall:
    async def run(self, data, *, base_url, api_key, model, **kw):
        return 1.0
"""
RAISING_LINE = (
    AGENT.splitlines().index(
        '        return float(data["missing_key"])  # the line a user must see'
    )
    + 1
)


def _debug_workflow(
    tmp_path: Path, *args: str, timeout_s: float = 180
) -> subprocess.CompletedProcess:
    (tmp_path / "agent.py").write_text(AGENT)
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "PYTHONIOENCODING": "utf-8"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "looprl.cli", "debug", "workflow", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def _on_tiny_model(tiny_model_dir: Path, tmp_path: Path, workflow: str) -> list[str]:
    return [
        *tiny_run_overrides(tiny_model_dir, tmp_path / "runs", f"workflow.path=agent:{workflow}"),
        "--concurrency",
        "2",
    ]


def _table(stdout: str) -> dict[str, str]:
    return dict(re.findall(r"^\s*[│|]\s*(\w+)\s*[│|]\s*(.*?)\s*[│|]\s*$", stdout, re.MULTILINE))


def test_with_no_server_it_starts_the_engine_and_prints_each_call(tiny_model_dir, tmp_path):
    done = _debug_workflow(tmp_path, *_on_tiny_model(tiny_model_dir, tmp_path, "Answers"))
    assert done.returncode == 0, done.stdout + done.stderr
    replies = [json.loads(line) for line in (tmp_path / "replies.jsonl").read_text().splitlines()]
    assert len(replies) == 3  # one rollout, then 2 at once
    out = done.stdout
    # The first rollout's call: the prompt's last message, the reply the agent got, its
    # finish reason (4 tokens asked: cut, and said so), then the reward.
    assert re.search(r"^user: What is .+\?$", out, re.MULTILINE)
    assert f"assistant (reply): {replies[0]}" in out
    assert "finish_reason length" in out
    assert "the reply was cut at max_tokens (4 tokens)" in out
    assert re.search(r"^rollout 1: reward 1 \(a reply cut at max_tokens\)", out, re.MULTILINE)
    report = _table(out)
    assert (report["rollouts"], report["rewards"], report["calls"]) == ("3", "3", "3")
    assert report["errors"] == "-"
    # Nothing written where a run would go, nor said about it.
    assert "run dir" not in done.stderr
    assert not (tmp_path / "runs").exists()


def test_a_workflow_that_raises_shows_its_own_traceback_once(tiny_model_dir, tmp_path):
    done = _debug_workflow(tmp_path, *_on_tiny_model(tiny_model_dir, tmp_path, "Raises"))
    assert done.returncode == 1, done.stdout + done.stderr
    where = f'agent.py", line {RAISING_LINE}, in run'
    assert done.stdout.count(where) == 1  # 3 rollouts, one error: its traceback once
    assert 'return float(data["missing_key"])' in done.stdout
    assert "KeyError: 'missing_key'" in done.stdout
    assert "looprl/rollout" not in done.stdout  # the frames that called it are left out
    assert "3 of 3 rollouts ended with KeyError" in done.stderr
    # The call it made before raising is shown too.
    assert "assistant (reply): " in done.stdout


def test_a_rollout_that_made_no_model_call_is_flagged(tiny_model_dir, tmp_path):
    done = _debug_workflow(tmp_path, *_on_tiny_model(tiny_model_dir, tmp_path, "NoCall"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no model call was recorded" in done.stdout
    assert "rollout 1: NoTrajectory: reward 1 returned, but no model call" in done.stdout
    assert "AsyncOpenAI(base_url=base_url, api_key=api_key)" in done.stdout  # the fix
    assert _table(done.stdout)["rewards"] == "0"
    assert "3 of 3 rollouts ended with NoTrajectory" in done.stderr


def test_a_base_url_where_nothing_listens_says_so_once_with_the_fix(tmp_path):
    url = f"http://127.0.0.1:{free_port()}/v1"
    done = _debug_workflow(tmp_path, "workflow.path=agent:Answers", "--base-url", url)
    assert done.returncode == 1, done.stdout + done.stderr
    said = " ".join(done.stderr.split())  # as one line, whatever the wrapping
    assert said.count(f"no server answers at --base-url {url}") == 1
    assert "`looprl serve --model default --port" in said
    assert "leave out --base-url to start the engine here" in said
    assert "Traceback" not in done.stderr + done.stdout
    assert "APIConnectionError" not in done.stderr + done.stdout
    assert done.stdout == ""
