"""A new user's mistakes, each told in one block before the model loads: `looprl train`,
`looprl train --dry-run` and `looprl doctor` run in subprocesses from a project folder
that holds the user's own agent module (looprl/preflight.py's checks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.tiny_run import tiny_run_overrides

# The training stack's import alone (~7 s) and start-up take longer than this; the
# checks answer in about 1 s (they import neither torch nor transformers), a few on 2
# cores shared with other test runs.
BEFORE_ANY_MODEL_S = 12.0

AGENTS = """\
class Agent:
    def __init__(self, greeting="hi"):
        self.greeting = greeting

    async def run(self, data, **kw):
        return 1.0


class Raises:
    def __init__(self):
        self.key = {}["missing_key"]

    async def run(self, data, **kw):
        return 1.0


def sync_agent(data, **kw):
    return 1.0
"""


def _line(text: str) -> int:
    """The line of AGENTS that starts with `text`."""
    return next(i for i, line in enumerate(AGENTS.splitlines(), 1) if line.startswith(text))


def _words(text: str) -> str:
    """`text` with its line breaks and runs of spaces as single spaces (rich wraps)."""
    return " ".join(text.split())


# (overrides, what the block says, doctor's row)
MISTAKES = {
    "missing train file": (
        ["task.name=jsonl", "task.train_path=data/train.jsonl"],
        ["task.train_path=data/train.jsonl:", "does not exist", "relative to the folder"],
        "data",
    ),
    "missing held-out file": (
        ["task.name=jsonl", "task.train_path=good.jsonl", "task.eval_path=held_out.jsonl"],
        ["task.eval_path=held_out.jsonl:", "does not exist"],
        "data",
    ),
    "no usable rows": (
        ["task.name=jsonl", "task.train_path=prompts.jsonl"],
        [
            "task.train_path=prompts.jsonl has no usable row",
            "prompts.jsonl:1: missing field(s) ['question']",
            "set task.prompt_field and task.answer_field",
        ],
        "data",
    ),
    "module not there": (
        ["workflow.path=my_agnets:Agent"],
        ["workflow.path 'my_agnets:Agent'", "cannot import module 'my_agnets'", "PYTHONPATH"],
        "workflow",
    ),
    "class not there": (
        ["workflow.path=my_agents:Agnet"],
        [
            "has no 'Agnet' (it has: Agent, Raises, sync_agent)",
            "my_agents.py",
            "set workflow.path to one of them",
        ],
        "workflow",
    ),
    "wrong constructor argument": (
        ["workflow.path=my_agents:Agent", "workflow.kwargs={greting: hello}"],
        [
            "cannot build workflow Agent",
            "unexpected keyword argument 'greting'",
            "it takes Agent(greeting='hi') (set workflow.kwargs to match)",
        ],
        "workflow",
    ),
    "constructor raises": (
        ["workflow.path=my_agents:Raises"],
        [
            "workflow.path=my_agents:Raises: KeyError: 'missing_key'",
            f"my_agents.py:{_line('        self.key')} in __init__",
            "Fix: correct your code at that line",
        ],
        "workflow",
    ),
    "sync function": (
        ["workflow.path=my_agents:sync_agent"],
        [
            "function sync_agent",
            f"my_agents.py:{_line('def sync_agent')}) is not a workflow",
            "make it `async def`",
        ],
        "workflow",
    ),
    "hub id as model.path": (
        ["model.path=Qwen/Qwen2.5-0.5B"],
        ["model.path=Qwen/Qwen2.5-0.5B:", "looprl loads local folders", "hf download"],
        "models",
    ),
}


@pytest.fixture
def project(tmp_path) -> Path:
    """A user's project folder: their agent module and data files."""
    (tmp_path / "my_agents.py").write_text(AGENTS)
    (tmp_path / "good.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n")
    return tmp_path


def _looprl(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "PYTHONPATH": str(cwd)}
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "looprl.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done, time.monotonic() - start


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_mistake_is_one_block_before_the_model_loads(mistake, project, tiny_model_dir):
    changes, says, row = MISTAKES[mistake]
    overrides = tiny_run_overrides(tiny_model_dir, project / "runs", *changes)

    done, took_s = _looprl("train", *overrides, cwd=project)
    assert done.returncode == 2, done.stderr
    assert took_s < BEFORE_ANY_MODEL_S, (took_s, done.stderr)
    assert "Start-up:" not in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.startswith("error: ") and done.stderr.count("error: ") == 1
    block = _words(done.stderr.partition("\n1 start-up check(s) failed")[0])
    for words in says:
        assert _words(words) in block, done.stderr
    assert "--debug prints their tracebacks" in done.stderr
    log = next((project / "runs").glob("*/*/train.log"))
    assert "Traceback (most recent call last)" in log.read_text()

    dry, _ = _looprl("train", "--dry-run", *overrides, cwd=project)
    assert dry.returncode == 2 and _words(says[0]) in _words(dry.stderr)
    assert "workflow:" in dry.stdout  # the resolved config, then the error

    doctor, _ = _looprl("doctor", *overrides, cwd=project)
    assert doctor.returncode == 1, doctor.stdout
    assert f"check(s) failed: {row}" in doctor.stderr
    assert any(line.lstrip("│| ").startswith(row) for line in doctor.stdout.splitlines())


def test_debug_prints_the_traceback_down_to_the_users_line(project, tiny_model_dir):
    overrides = tiny_run_overrides(
        tiny_model_dir, project / "runs", "workflow.path=my_agents:Raises"
    )
    done, _ = _looprl("train", "--debug", *overrides, cwd=project)
    assert done.returncode == 2
    traceback = done.stderr.partition("Traceback (most recent call last)")[2]
    assert f'my_agents.py", line {_line("        self.key")}, in __init__' in traceback
    assert traceback.rstrip().endswith("1 start-up check(s) failed")


def test_a_correct_config_passes_the_checks(project, tiny_model_dir):
    overrides = tiny_run_overrides(
        tiny_model_dir,
        project / "runs",
        "task.name=jsonl",
        "task.train_path=good.jsonl",
        "workflow.path=my_agents:Agent",
        "workflow.kwargs={greeting: hello}",
    )
    dry, _ = _looprl("train", "--dry-run", *overrides, cwd=project)
    assert dry.returncode == 0, dry.stderr
    assert dry.stderr == "" and "my_agents:Agent" in dry.stdout
    assert not (project / "runs").exists()  # a dry run writes nothing


def test_the_checks_import_neither_torch_nor_transformers(project):
    """What keeps the first error within a second or two of the command."""
    code = (
        "import asyncio, sys; from looprl import preflight; from looprl.config import "
        "load_config; asyncio.run(preflight.check(load_config(None, "
        "['workflow.path=my_agents:Agent', 'model.path=Qwen/Qwen2.5-0.5B']))); "
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    env = {**os.environ, "PYTHONPATH": str(project)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=project, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
