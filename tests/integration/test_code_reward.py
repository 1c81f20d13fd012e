"""reward.type=code: real programs in real bubblewrap boxes, scored through
`CodeReward.score`.

The hostile suite (tests/support/hostile.py) runs as this user (root in CI) and as an
unprivileged user created for it, in the box and under the opt-in unisolated mode: in
the box every trick scores 0 and nothing survives; unisolated, the verdict tricks still
score 0 (the verdict is made outside the program) and the isolation tricks that get out
are exactly the ones docs/rewards.md lists. Network isolation is tested only against
listeners the tests open on loopback. Tests that need bubblewrap skip where it is
missing (make test installs it where it can).
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from looprl.config import CodeRewardConfig
from looprl.rewards import RewardFailed
from looprl.rewards.cases import parse_test
from looprl.rewards.code import CodeReward, extract_program
from looprl.rewards.sandbox import Sandbox, SandboxUnavailable, bubblewrap_missing
from looprl.rewards.verdict import judge_verdicts, program_values
from tests.support.as_user import ROOT, USERS, run_module_json
from tests.support.tiny_run import train_two_steps

NO_BOX = bubblewrap_missing()
needs_box = pytest.mark.skipif(NO_BOX is not None, reason=f"no box here: {NO_BOX}")

LIMITS = dict(timeout_s=8.0, cpu_time_s=2, memory_mb=256, max_processes=16, disk_mb=16)

# What the unisolated mode cannot stop (docs/rewards.md, Code): the isolation tricks that
# score 1, the one that gets its rollout rejected instead of scored, and what is left.
UNISOLATED_GETS_OUT = {
    "reads a 0600 file of this user",
    "reads the trainer's environment from /proc",
    "connects to a loopback TCP server",
    "connects to an owner-only Unix socket",
    "connects to an abstract Unix socket",
}
UNISOLATED_GETS_OUT_AS_ROOT = {"reads /etc/shadow"}
UNISOLATED_REJECTED = {"drains every pipe it can open"}


@pytest.fixture
def box() -> Sandbox:
    return Sandbox(CodeRewardConfig(**LIMITS))


def test_the_program_is_the_last_fenced_block():
    text = "First:\n```python\nx = 1\n```\nBetter:\n```\ndef f():\n    return 2\n```\n"
    assert extract_program(text) == "def f():\n    return 2\n"
    assert extract_program("def f(): return 2") == "def f(): return 2"


@needs_box
async def test_pass_fraction_counts_each_test_on_its_own():
    reward = CodeReward(CodeRewardConfig(**LIMITS))
    row = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert add(0, 0) == 0"]}
    async with reward.rollout(row) as score:
        value = await score("Write add.", "```python\ndef add(a, b):\n    return a + b\n```")
    assert value == pytest.approx(2 / 3)
    stdio = {"tests": [{"input": "2 3\n", "output": "5\n"}, {"input": "1 1\n", "output": "3"}]}
    program = "a, b = map(int, input().split())\nprint(a + b)\n"
    async with reward.rollout(stdio) as score:
        assert await score("", program) == 0.5
    stats = reward.take_stats()
    assert stats["reward_code_tests"] == 5 and stats["reward_code_tests_passed"] == 3
    assert stats["reward_code_rollouts"] == 2 and stats["reward_code_sandbox_errors"] == 0
    assert reward.take_stats()["reward_code_tests"] == 0  # since the last call


def _suite(isolation: str, as_user: bool) -> dict:
    return run_module_json("tests.support.hostile", [isolation], as_user, timeout=240)


@needs_box
@pytest.mark.parametrize("as_user", USERS)
def test_every_trick_scores_0_in_the_box_and_nothing_survives(as_user):
    result = _suite("bubblewrap", as_user)
    scores = result.pop("scores")
    assert scores.pop("honest (control)") == 1.0
    assert scores == dict.fromkeys(scores, 0.0)  # 0, not None: scored, not rejected
    assert len(scores) == 24 + 23
    assert result["honest"] == dict.fromkeys(result["honest"], 1.0)
    assert len(result["honest"]) == 23
    assert result["survivors"] == [] and result["written_outside"] == []
    assert result["skipped"] == {} and result["stats"]["reward_code_sandbox_errors"] == 0
    assert ("a user namespace" in result["box"]) == (as_user or not ROOT), result["box"]
    assert (result["uid"] == 0) == (ROOT and not as_user)


@pytest.mark.parametrize("as_user", USERS)
def test_unisolated_stops_the_verdict_tricks_and_no_more_than_it_says(as_user):
    result = _suite("unisolated", as_user)
    scores = result["scores"]
    root = result["uid"] == 0
    gets_out = UNISOLATED_GETS_OUT | (UNISOLATED_GETS_OUT_AS_ROOT if root else set())
    assert {name for name, s in scores.items() if s == 1.0} == gets_out | {"honest (control)"}
    assert {name for name, s in scores.items() if s is None} == UNISOLATED_REJECTED
    assert result["honest"] == dict.fromkeys(result["honest"], 1.0)
    assert result["skipped"] == {
        "a fork bomb": "not run: unisolated has no process cap (it would bomb here)"
    }
    assert len(result["survivors"]) == 1  # the setsid survivor (killed by the suite)
    assert len(result["written_outside"]) == 2  # /tmp and /dev/shm


# ---- the verdict: right programs the split once scored 0 -------------------------------

RIGHT_ANSWERS = {
    "bitwise operators": (
        "def f(x):\n    return x\n",
        "assert f(3) & 1 == 1\nassert f(1) << 2 == 4\nassert f(6) ^ 2 | 1 == 5",
    ),
    "a generator over the program's list": (
        "def f(n):\n    return list(range(1, n + 1))\n",
        "assert all(x > 0 for x in f(3))\nassert [x * 2 for x in f(2)] == [2, 4]",
    ),
    "an int of 5,000 digits": (
        "def f(n):\n    return 10 ** n\n",
        "assert f(5000) == 10 ** 5000\nassert f(5000) % 7 == pow(10, 5000, 7)",
    ),
    "type() of a result": ("def f(x):\n    return 2 * x\n", "assert type(f(2)) == int"),
    "complex numbers": ("def f(x):\n    return x + 2j\n", "assert f(1) == 1 + 2j"),
    "sorting in place": (
        "def sort_in_place(a):\n    a.sort()\n",
        "a = [3, 1, 2]\nsort_in_place(a)\nassert a == [1, 2, 3]",
    ),
    "a generator returned": (
        "def f(n):\n    yield from range(n)\n",
        "assert list(f(3)) == [0, 1, 2]\nassert next(f(3)) == 0",
    ),
    "a Counter and a namedtuple returned": (
        "from collections import Counter, namedtuple\nP = namedtuple('P', 'x y')\n"
        "def f(s):\n    return Counter(s)\ndef g():\n    return P(1, 2)\n",
        "assert f('aab') == {'a': 2, 'b': 1}\nassert g() == (1, 2)",
    ),
    "an object of the program, used through its methods": (
        "class Stack:\n    def __init__(self):\n        self.items = []\n"
        "    def push(self, x):\n        self.items.append(x)\n"
        "    def pop(self):\n        return self.items.pop()\n",
        "s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2\nassert s.items == [1]",
    ),
    "nan and inf": (
        "def f(x):\n    return float(x)\n",
        "import math\nassert math.isnan(f('nan'))\nassert f('-inf') < 0 and math.isinf(f('-inf'))",
    ),
    "HumanEval's check with a debugging assert True": (
        "def f(x):\n    return 2 * x\n",
        "def check(candidate):\n    assert True, 'debug'\n    assert candidate(2) == 4\n\n"
        "check(f)\n",
    ),
}


@needs_box
@pytest.mark.parametrize("name", RIGHT_ANSWERS)
async def test_right_programs_score_1(name):
    program, test = RIGHT_ANSWERS[name]
    reward = CodeReward(CodeRewardConfig(**LIMITS))
    assert await reward.score(program, {"tests": [test]}) == 1.0
    assert await reward.score("def f(*a):\n    return None\n", {"tests": [test]}) == 0.0


@needs_box
async def test_a_failing_judge_says_why():
    reward = CodeReward(CodeRewardConfig(**LIMITS))
    test = parse_test("import math\nassert math.isclose(f(1.0), 2.5)\nassert f(2) == 4")
    run = await reward.sandbox.run("def f(x):\n    return 2 * x\n", test.program_script)
    values, why = program_values(test, run.records)
    assert why == "" and json.loads(values) == [[{"value": 2.0}], [{"value": 4}]]
    judged = await reward.sandbox.run("", test.judge_script, data=values)
    assert judge_verdicts(test, judged.records) == (
        False,
        "line 2: `assert math.isclose(f(1.0), 2.5)` is false",
    )


@needs_box
@pytest.mark.slow  # fills each box's budgets in turn: ~45 s on 2 cores
async def test_budgets_are_per_box(box):
    bomb = (
        "import os, time\nforked = 0\nfor _ in range(200):\n    try:\n"
        "        pid = os.fork()\n    except OSError:\n        continue\n"
        "    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    forked += 1\n"
        "print('forked', forked)\n"
    )
    start = time.monotonic()
    runs = await asyncio.gather(box.run(bomb, ""), box.run(bomb, ""))
    # Both boxes at once: each counts only its own processes (the second's first fork
    # is not refused for the first's), and the sleepers went down with their boxes.
    for run in runs:
        assert run.started and run.returncode == 0, run.output
        assert int(run.output.split("forked ")[1].split()[0]) == LIMITS["max_processes"] - 1
    assert time.monotonic() - start < 10

    memory = (
        "import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n"
        "        block = bytearray(100 * 2**20)\n"
        "        block[::4096] = b'1' * (len(block) // 4096)\n"
        "        time.sleep(10)\n        os._exit(0)\ntime.sleep(10)\n"
    )
    run = await box.run(memory, "")  # 3 x 100 MiB, each under 256 MiB, over it together
    assert run.killed_for == "memory" and run.elapsed_s < 5

    # 20 files of 0.9 MB (each under the 1 MB file limit) in a 16 MiB work dir.
    disk = "for i in range(20):\n    open(f'{i}', 'wb').write(bytes(900_000))\nprint('wrote all')\n"
    run = await box.run(disk, "")
    assert "No space left on device" in run.output and "wrote all" not in run.output


@needs_box
async def test_the_clock_and_the_cpu_limit_stop_a_run(box):
    start = time.monotonic()
    run = await box.run("while True:\n    pass\n", "")
    assert run.timed_out and time.monotonic() - start < LIMITS["timeout_s"]  # the CPU limit
    sleeper = Sandbox(CodeRewardConfig(**{**LIMITS, "timeout_s": 1.5}))
    run = await sleeper.run("import time\ntime.sleep(60)\n", "")
    assert run.timed_out and run.elapsed_s < 4


@needs_box
async def test_nothing_of_the_host_is_in_the_box(box, tmp_path):
    spaced = tmp_path / "a mount point with a space"
    spaced.mkdir()
    (spaced / "victim.txt").write_text("keep me")
    program = (
        "import os\n"
        f"for path in ({str(spaced / 'victim.txt')!r}, {str(tmp_path)!r}, '/etc/passwd',\n"
        "             os.path.expanduser('~root'), '/run', '/home'):\n"
        "    print(path, os.path.exists(path))\n"
        "print(sorted(os.listdir('/')), '|', sorted(os.environ))\n"
        f"open({str(spaced / 'new.txt')!r}, 'w')\n"
    )
    run = await box.run(program, "")
    assert "True" not in run.output.split("[")[0], run.output
    top, environment = [line for line in run.output.splitlines() if " | " in line][0].split(" | ")
    interpreter = Path(os.path.realpath(sys.base_prefix)).parts[1]  # /root here
    system = {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr"}
    assert set(ast.literal_eval(top)) - system - {interpreter} == {"dev", "proc", "tmp", "work"}
    assert set(ast.literal_eval(environment)) <= {"HOME", "LANG", "PATH", "PWD", "TMPDIR"}
    assert "FileNotFoundError" in run.output and not (spaced / "new.txt").exists()


@needs_box
async def test_a_box_that_cannot_start_rejects_counts_and_stops_the_run(monkeypatch):
    reward = CodeReward(CodeRewardConfig(**LIMITS))
    monkeypatch.setattr("looprl.rewards.sandbox.sys.executable", "/nonexistent/python")
    async with reward.rollout({"tests": ["assert f() == 1"]}) as score:
        assert await score("", "def f(): return 1") is None
    reward.check_failures(max_rate=0.5, min_judgments=4)  # 1 of 4: goes on
    for _ in range(2):
        assert await reward.score("def f(): return 1", {"tests": ["assert f() == 1"]}) is None
    with pytest.raises(RewardFailed, match=r"3 of 3 rollouts .* reward.max_failure_rate=0.5"):
        reward.check_failures(max_rate=0.5, min_judgments=4)
    assert reward.take_stats()["reward_code_sandbox_errors"] == 3


async def test_without_bubblewrap_code_training_refuses_to_start(tiny_run, tmp_path, monkeypatch):
    empty = tmp_path / "bin"
    empty.mkdir()
    for tool in ("python3", "sh"):  # what else might be looked up on PATH
        if shutil.which(tool):
            (empty / tool).symlink_to(shutil.which(tool))
    monkeypatch.setenv("PATH", str(empty))
    cfg = tiny_run("reward.type=code", *_code_task(tmp_path))
    from looprl.loop import train

    with pytest.raises(SandboxUnavailable) as refused:
        await train(cfg, show_progress=False)
    message = str(refused.value)
    assert "apt-get install bubblewrap" in message
    assert "reward.code.isolation=unisolated" in message


def _code_task(tmp_path: Path) -> list[str]:
    data = tmp_path / "code.jsonl"
    rows = [
        {
            "question": f"Write f(x) returning x + {k}.",
            "answer": f"def f(x): return x + {k}",
            "tests": [f"assert f(1) == {1 + k}", f"assert f(0) == {k}"],
        }  # fmt: skip
        for k in range(4)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["task.name=jsonl", f"task.train_path={data}", f"task.eval_path={data}"]


@needs_box
@pytest.mark.slow  # a training run whose every reward is a sandboxed program: ~20 s
async def test_code_reward_trains(tiny_run, tmp_path):
    """`looprl train reward.type=code` on a JSONL file: two steps, the counters per step."""
    cfg = tiny_run(
        "reward.type=code",
        *_code_task(tmp_path),
        "reward.code.timeout_s=5",
        "sampling.max_new_tokens=8",
        "eval.size=2",
        "eval.max_new_tokens=8",
    )
    _, steps, _ = await train_two_steps(cfg)  # in under a minute
    # 2 prompts x 2 samples x 2 tests per step (step 1 also counts the first evaluation).
    assert steps[1]["reward_code_tests"] == 8
    assert steps[0]["reward_code_tests"] == 8 + 2 * 2
    assert all(r["reward_code_sandbox_errors"] == 0 for r in steps)
    assert all(r["completed"] == 4 and r["reward_mean"] == 0.0 for r in steps)
