"""The code reward's box holds no memory outside its budget and never outlives its reward
call: real programs (tests/support/hostile_box.py) in real bubblewrap boxes, run as this
user (root in CI) and as an unprivileged user, and what they left on the host."""

from __future__ import annotations

import pytest

from looprl.config import CodeRewardConfig
from looprl.rewards import seccomp
from looprl.rewards.sandbox import Sandbox, SandboxUnavailable, bubblewrap_missing
from tests.support.as_user import ROOT, USERS, run_module_json
from tests.support.hostile_box import DISK_MB

NO_BOX = bubblewrap_missing()
needs_box = pytest.mark.skipif(NO_BOX is not None, reason=f"no box here: {NO_BOX}")
REFUSED = "Operation not permitted"


def _hostile_box(part: str, as_user: bool) -> dict:
    return run_module_json("tests.support.hostile_box", [part], as_user, timeout=120)


@needs_box
@pytest.mark.parametrize("as_user", USERS)
def test_memory_outside_the_budget_is_refused_or_charged(as_user):
    result = _hostile_box("memory", as_user)
    found = result["programs"]
    assert ("a user namespace" in result["box"]) == (as_user or not ROOT), result["box"]
    for name, run in found.items():
        assert run["error"] is None, (name, run)
        # Shared memory of any kind shows in the host's Shmem: at most the box's disk
        # while it ran, none once it is over.
        assert run["shmem_rise_mib"] <= DISK_MB + 8 and run["shmem_left_mib"] <= 4, (name, run)
    for name in ("memfd files", "SysV shared memory", "SysV message queues", "TCP socket buffers"):
        assert REFUSED in found[name]["refused"] and found[name]["held_mib"] == 0, found[name]
    shm = found["POSIX shared memory in /dev/shm"]  # the box's tmpfs
    assert "No space left on device" in shm["refused"] and shm["held_mib"] <= DISK_MB + 1, shm
    pipes = found["pipe buffers"]  # F_SETPIPE_SZ refused: 64 KiB a pipe, 64 files a process
    assert REFUSED in pipes["refused"] and pipes["held_mib"] <= 2, pipes
    sockets = found["Unix socket buffers"]  # SO_SNDBUF refused, each socket charged
    assert REFUSED in sockets["refused"] and sockets["killed_for"] == "memory", sockets
    files = found["many open files"]
    assert "Too many open files" in files["refused"] and files["opened"] < 64, files


@needs_box
@pytest.mark.parametrize("as_user", USERS)
def test_a_cancelled_call_leaves_no_box_and_frees_its_slot(as_user):
    result = _hostile_box("cancel", as_user)
    # 3 rounds of 2 calls ended by their timeout, then 2 calls cancelled twice each: no
    # box left when each returned; the next 2 calls got both slots at once.
    assert result["live_after_each"] == [0] * 5 and result["survivors"] == 0, result
    assert result["next_s"] < 5, result


@needs_box
@pytest.mark.parametrize("as_user", USERS)
def test_a_killed_trainer_leaves_no_box(as_user):
    result = _hostile_box("trainer", as_user)
    expected = {"started": True, "left": 0}
    assert result == {"SIGKILL": expected, "SIGTERM": expected}


async def test_unisolated_refuses_the_same_calls_but_sockets():
    run = await Sandbox(CodeRewardConfig(isolation="unisolated")).run(
        "import os, fcntl, socket\n"
        "for name, call in [('memfd', lambda: os.memfd_create('x')),\n"
        "                   ('pipe size', lambda: fcntl.fcntl(os.pipe()[1], 1031, 1 << 20)),\n"
        "                   ('tcp', lambda: socket.socket().close())]:\n"
        "    try:\n        call()\n        print(name, 'allowed')\n"
        "    except OSError as e:\n        print(name, e.strerror)\n"
    )
    assert run.stdout.splitlines() == [
        f"memfd {REFUSED}",
        f"pipe size {REFUSED}",
        "tcp allowed",  # unisolated programs reach the network (docs/security.md)
    ], run.output


@needs_box
def test_no_filter_no_box(monkeypatch):
    """A filter libseccomp cannot build (here, a call it does not know) starts no box in
    either isolation: the sandbox says why instead of running weaker."""
    monkeypatch.setattr(seccomp, "_REFUSED_CALLS", (*seccomp._REFUSED_CALLS, "no_such_call"))
    assert "no_such_call" in bubblewrap_missing()
    for isolation in ("bubblewrap", "unisolated"):
        with pytest.raises(SandboxUnavailable, match="no_such_call"):
            Sandbox(CodeRewardConfig(isolation=isolation))
