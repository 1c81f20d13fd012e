"""The start-up checks (looprl/preflight.py) on real files: each common mistake is one
problem naming the setting, the file and line where it is the user's, and the fix;
a correct config has none."""

import asyncio
import json
import sys
import textwrap

import pytest

from looprl import preflight
from looprl.config import load_config

AGENTS = """\
class Echo:
    def __init__(self, greeting="hi"):
        self.greeting = greeting

    async def run(self, data, **kw):
        return 1.0


class Raises:
    def __init__(self):
        self.key = {}["missing_key"]

    async def run(self, data, **kw):
        return 1.0


class SyncRun:
    def run(self, data, **kw):
        return 1.0


def sync_agent(data, **kw):
    return 1.0


class Closes:
    def __init__(self, marker):
        self.marker = marker

    async def run(self, data, **kw):
        return 1.0

    def close(self):
        open(self.marker, "w").close()
"""


@pytest.fixture
def agents(tmp_path, monkeypatch):
    """A user's fresh module `my_agents` in tmp_path, importable; returns a writer that
    replaces its source."""

    def write(source: str = AGENTS, name: str = "my_agents"):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        monkeypatch.delitem(sys.modules, name, raising=False)
        return tmp_path / f"{name}.py"

    monkeypatch.syspath_prepend(str(tmp_path))
    return write


def _line(text: str) -> int:
    """The line of AGENTS that starts with `text`."""
    return next(i for i, line in enumerate(AGENTS.splitlines(), 1) if line.startswith(text))


def _check(*overrides: str) -> list[preflight.Problem]:
    return asyncio.run(preflight.check(load_config(None, list(overrides))))


def _one(*overrides: str) -> preflight.Problem:
    (problem,) = _check(*overrides)
    return problem


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_correct_config_has_no_problem(agents, tmp_path):
    agents()
    assert _check() == []  # the default job
    data = _jsonl(tmp_path / "train.jsonl", [{"question": "1+1?", "answer": "2"}])
    overrides = ("task.name=jsonl", f"task.train_path={data}", f"task.eval_path={data}")
    assert _check(*overrides) == []
    assert _check("workflow.path=my_agents:Echo", "workflow.kwargs={greeting: hello}") == []


def test_a_missing_data_file_names_its_field(tmp_path):
    problem = _one("task.name=jsonl", f"task.train_path={tmp_path / 'nope.jsonl'}")
    assert problem.part == "data"
    assert problem.what.startswith(f"task.train_path={tmp_path / 'nope.jsonl'}")
    assert "does not exist" in problem.block() and "relative to the folder" in problem.block()
    data = _jsonl(tmp_path / "train.jsonl", [{"question": "1+1?", "answer": "2"}])
    held_out = f"task.eval_path={tmp_path / 'held_out.jsonl'}"
    problem = _one("task.name=jsonl", f"task.train_path={data}", held_out)
    assert problem.what.startswith(held_out) and "does not exist" in problem.what


def test_a_file_without_usable_rows_says_why(tmp_path):
    data = _jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1?", "answer": "2"}] * 3)
    block = _one("task.name=jsonl", f"task.train_path={data}").block()
    assert f"task.train_path={data} has no usable row" in block
    assert f"{data}:1: missing field(s) ['question']" in block  # the first row, its line
    assert "set task.prompt_field and task.answer_field" in block
    (tmp_path / "empty.jsonl").write_text("")
    block = _one("task.name=jsonl", f"task.train_path={tmp_path / 'empty.jsonl'}").block()
    assert "(it is empty)" in block


def test_a_workflow_module_that_is_not_there():
    block = _one("workflow.path=no_such_agents:Agent").block()
    assert "workflow.path 'no_such_agents:Agent'" in block
    assert "cannot import module 'no_such_agents'" in block and "PYTHONPATH" in block


def test_a_workflow_name_the_module_lacks_lists_what_it_has(agents):
    file = agents()
    problem = _one("workflow.path=my_agents:Echoes")
    assert problem.part == "workflow"
    assert f"module 'my_agents' ({file}) has no 'Echoes'" in problem.what
    assert "(it has: Echo, Raises, SyncRun, sync_agent, Closes)" in problem.what
    assert problem.what.endswith("; set workflow.path to one of them")


def test_a_constructor_that_raises_shows_the_users_line(agents):
    file = agents()
    problem = _one("workflow.path=my_agents:Raises")
    assert problem.what == "workflow.path=my_agents:Raises: KeyError: 'missing_key'"
    assert problem.where == f"{file}:{_line('        self.key')} in __init__"
    assert problem.fix and "Traceback" in problem.traceback


def test_a_module_that_fails_on_import_shows_the_users_line(agents):
    file = agents("import json\nCONFIG = json.loads('{')\n")
    problem = _one("workflow.path=my_agents:Agent")
    assert problem.what.startswith("workflow.path=my_agents:Agent: JSONDecodeError")
    assert problem.where == f"{file}:2 in <module>"
    file = agents("class Agent:\n    async def run(self, data **kw):\n        pass\n")
    assert _one("workflow.path=my_agents:Agent").where == f"{file}:2"  # a SyntaxError


def test_wrong_constructor_arguments_show_what_it_takes(agents):
    file = agents()
    block = _one("workflow.path=my_agents:Echo", "workflow.kwargs={greting: hello}").block()
    assert f"cannot build workflow Echo(**{{'greting': 'hello'}}) ({file}:1)" in block
    assert "unexpected keyword argument 'greting'" in block
    assert "it takes Echo(greeting='hi') (set workflow.kwargs to match)" in block


def test_a_sync_workflow_says_to_make_it_async(agents):
    file = agents()
    block = _one("workflow.path=my_agents:sync_agent").block()
    assert f"function sync_agent ({file}:{_line('def sync_agent')}) is not a workflow" in block
    assert "make it `async def`" in block
    block = _one("workflow.path=my_agents:SyncRun").block()
    assert f"workflow class SyncRun ({file}:{_line('class SyncRun')}) needs `async def run" in block
    assert "it has a plain `def run`" in block


def test_a_hub_id_as_model_path_says_looprl_loads_local_folders():
    problem = _one("model.path=Qwen/Qwen2.5-0.5B")
    assert problem.part == "models"
    assert problem.what.startswith("model.path=Qwen/Qwen2.5-0.5B:")
    assert "looks like a Hugging Face Hub id" in problem.what
    assert "looprl loads local folders" in problem.what
    assert "set model.path=models/Qwen2.5-0.5B" in problem.what


def test_a_folder_without_config_is_not_a_model(tmp_path):
    (tmp_path / "model").mkdir()
    problem = _one(f"model.path={tmp_path / 'model'}")
    assert "has no config.json" in problem.what


def test_a_missing_extra_names_its_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # find_spec answers None: not installed
    problem = _one("scheduler.type=ray")
    assert problem.part == "extras" and "pip install 'looprl[ray]'" in problem.what


def test_a_judge_is_checked_without_being_started(monkeypatch):
    # Served by the run: its reward is built on an address nothing answers, never called.
    assert _check("reward.type=judge") == []
    monkeypatch.delenv("JUDGE_KEY", raising=False)
    remote = ("reward.type=judge", "reward.judge.base_url=http://127.0.0.1:9/v1")
    problem = _one(*remote, "reward.judge.api_key_env=JUDGE_KEY")
    assert problem.part == "reward" and "'JUDGE_KEY'" in problem.what


def test_the_workflow_built_is_closed(agents, tmp_path):
    agents()
    marker = tmp_path / "closed"
    assert _check("workflow.path=my_agents:Closes", f"workflow.kwargs={{marker: {marker}}}") == []
    assert marker.exists()


def test_an_env_is_built_once_by_its_workers(tmp_path):
    env = ("env.name=gymnasium:FrozenLake-v1", "env.workers=1", f"run.fileroot={tmp_path}")
    assert _check(*env, "env.frames_every=2") == []  # the run's frames folder is named
    problem = _one("env.name=gymnasium:NoSuchLake-v0", "env.workers=1")
    assert problem.part == "workflow" and "NoSuchLake-v0" in problem.what


def test_a_library_error_names_the_setting_the_exception_and_where(tmp_path):
    pytest.importorskip("pyarrow")
    (tmp_path / "train.parquet").write_text("not parquet")
    problem = _one("task.name=parquet", f"task.train_path={tmp_path / 'train.parquet'}")
    assert problem.part == "data" and problem.what.startswith("task.name=parquet: Arrow")
    assert "pyarrow" in problem.where and not problem.fix


def test_a_reward_module_that_fails_on_import_names_task_reward(agents, tmp_path):
    file = agents("def math_reward(prompt, completion, **row):\n    return 1.0\n\n1 / 0\n")
    data = _jsonl(tmp_path / "train.jsonl", [{"question": "1+1?", "answer": "2"}])
    problem = _one(
        "task.name=jsonl", f"task.train_path={data}", "task.reward=my_agents:math_reward"
    )
    assert problem.what == "task.reward=my_agents:math_reward: ZeroDivisionError: division by zero"
    assert problem.where == f"{file}:4 in <module>"
