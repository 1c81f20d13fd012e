"""reward.type=code: real programs in the real sandbox, hostile ones included, and a
two-step training run scored by it.

The hostile programs' tests check what the sandbox promises: a fork bomb stops at the
process limit, a busy loop at the CPU limit, a sleeper at the wall clock, a file outside
the work dir survives its deletion, a connection to a server on this machine's loopback
fails, a huge allocation fails. Tests that need namespaces skip where `unshare` cannot
make them (the reason is the probe's).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time

import pytest

from looprl.config import CodeRewardConfig
from looprl.rewards.code import CodeReward, extract_program
from looprl.rewards.sandbox import Sandbox, namespaces_available
from tests.support.tiny_run import train_two_steps

NO_NAMESPACES = namespaces_available()
needs_namespaces = pytest.mark.skipif(
    NO_NAMESPACES is not None, reason=f"no namespaced sandbox here: {NO_NAMESPACES}"
)

LIMITS = dict(timeout_s=8.0, cpu_time_s=2, memory_mb=512, max_processes=16)


@pytest.fixture
def sandbox() -> Sandbox:
    return Sandbox(CodeRewardConfig(isolation="namespaces", **LIMITS))


@pytest.fixture
def any_sandbox() -> Sandbox:
    """Namespaces where the machine allows them, else resource limits only."""
    return Sandbox(CodeRewardConfig(isolation="auto", **LIMITS))


def test_the_program_is_the_last_fenced_block():
    text = "First:\n```python\nx = 1\n```\nBetter:\n```\ndef f():\n    return 2\n```\n"
    assert extract_program(text) == "def f():\n    return 2\n"
    assert extract_program("def f(): return 2") == "def f(): return 2"


@needs_namespaces
async def test_pass_fraction_counts_each_test_on_its_own():
    reward = CodeReward(CodeRewardConfig(isolation="namespaces", **LIMITS))
    row = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert add(0, 0) == 0"]}
    async with reward.rollout(row) as score:
        value = await score("Write add.", "```python\ndef add(a, b):\n    return a + b\n```")
    assert value == pytest.approx(2 / 3)
    async with reward.rollout({"tests": "assert add(1, 1) == 2\nprint('ok')"}) as score:
        assert await score("", "def add(a, b): return a + b") == 1.0
    stats = reward.take_stats()
    assert stats["reward_code_tests"] == 4 and stats["reward_code_tests_passed"] == 3
    assert stats["reward_code_timeouts"] == 0 and stats["reward_code_sandbox_errors"] == 0
    assert reward.take_stats()["reward_code_tests"] == 0  # since the last call


@needs_namespaces
async def test_exiting_early_is_not_a_pass(sandbox):
    for program in ("import sys; sys.exit(0)", "import os; os._exit(0)"):
        run = await sandbox.run(program, "assert False")
        assert run.status == "failed", program


@needs_namespaces
async def test_a_fork_bomb_stops_at_the_process_limit(sandbox):
    program = (
        "import os, time\n"
        "forked = refused = 0\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        pid = os.fork()\n"
        "    except OSError:\n"
        "        refused += 1\n"
        "        continue\n"
        "    if pid == 0:\n"
        "        time.sleep(30)\n"
        "        os._exit(0)\n"
        "    forked += 1\n"
        "print('forked', forked, 'refused', refused)\n"
    )
    start = time.monotonic()
    run = await sandbox.run(program, "")
    assert run.status == "passed", run.output
    forked = int(run.output.split("forked ")[1].split()[0])
    assert forked < LIMITS["max_processes"] and "refused" in run.output
    # The sleeping children went down with the run, not 30 s later.
    assert time.monotonic() - start < 10


@needs_namespaces
async def test_a_classic_fork_bomb_is_contained_and_counted():
    reward = CodeReward(CodeRewardConfig(isolation="namespaces", **{**LIMITS, "timeout_s": 3}))
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    async with reward.rollout({"tests": ["pass"]}) as score:
        assert await score("", bomb) == 0.0
    assert reward.take_stats()["reward_code_timeouts"] == 1


async def test_an_infinite_loop_is_stopped(any_sandbox):
    start = time.monotonic()
    run = await any_sandbox.run("while True:\n    pass\n", "")
    assert run.status == "timed_out"
    assert time.monotonic() - start < LIMITS["timeout_s"]  # the CPU limit, before the clock
    # A sleeper uses no CPU: the wall clock stops it.
    sleeper = Sandbox(CodeRewardConfig(isolation="auto", **{**LIMITS, "timeout_s": 2.0}))
    run = await sleeper.run("import time\ntime.sleep(60)\n", "")
    assert run.status == "timed_out" and run.elapsed_s < 5


async def test_huge_memory_fails_inside(any_sandbox):
    run = await any_sandbox.run("x = bytearray(8 * 2**30)\n", "")
    assert run.status == "failed" and "MemoryError" in run.output


@needs_namespaces
async def test_files_outside_the_work_dir_survive(sandbox, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    program = (
        "import os, shutil\n"
        f"for attempt in (lambda: os.remove({str(victim)!r}),\n"
        f"                lambda: shutil.rmtree({str(tmp_path)!r}),\n"
        f"                lambda: open({str(victim)!r}, 'w').write('gone'),\n"
        "                lambda: open('/tmp/looprl-sandbox-escape', 'w')):\n"
        "    try:\n"
        "        attempt()\n"
        "    except OSError as e:\n"
        "        print('refused', e.errno)\n"
        "open('mine.txt', 'w').write('the work dir is writable')\n"
        "print(open('mine.txt').read())\n"
    )
    run = await sandbox.run(program, "")
    assert run.status == "passed", run.output
    assert run.output.count("refused") == 4 and "the work dir is writable" in run.output
    assert victim.read_text() == "keep me"
    assert not os.path.exists("/tmp/looprl-sandbox-escape")


@needs_namespaces
async def test_no_network(sandbox):
    # A server on this machine's loopback: reachable from here, not from the sandbox.
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(
        target=lambda: accepted.append(server.accept()), daemon=True, name="accept"
    ).start()
    program = (
        "import socket\n"
        f"socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
        "print('connected')\n"
    )
    try:
        run = await sandbox.run(program, "")
        assert run.status == "failed" and "connected" not in run.output
        assert "OSError" in run.output or "Error" in run.output
        await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port), 3)
        await asyncio.sleep(0.2)
        assert len(accepted) == 1  # it was there all along
    finally:
        server.close()


@needs_namespaces
async def test_the_environment_is_scrubbed_and_the_work_dir_removed(sandbox, monkeypatch):
    monkeypatch.setenv("LOOPRL_SECRET_TOKEN", "hunter2")
    run = await sandbox.run("import os\nprint(sorted(os.environ), os.getcwd())\n", "")
    assert run.status == "passed" and "LOOPRL_SECRET_TOKEN" not in run.output
    workdir = run.output.split("] ")[1].split()[0]
    assert not os.path.exists(workdir)


async def test_a_broken_sandbox_rejects_and_counts(monkeypatch):
    reward = CodeReward(CodeRewardConfig(isolation="rlimits", **LIMITS))
    monkeypatch.setattr("looprl.rewards.sandbox.sys.executable", "/nonexistent/python")
    async with reward.rollout({"tests": ["pass"]}) as score:
        assert await score("", "x = 1") is None
    assert reward.take_stats()["reward_code_sandbox_errors"] == 1


async def test_code_reward_trains(tiny_run, tmp_path):
    """`looprl train reward.type=code` on a JSONL file: two steps, the counters per step."""
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
    cfg = tiny_run(
        "task.name=jsonl",
        f"task.train_path={data}",
        f"task.eval_path={data}",
        "reward.type=code",
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
