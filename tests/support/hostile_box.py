"""Programs that try to hold memory outside the code reward's box budget, or to outlive
the reward call that started their box, and what each left on the host.

Three parts, each run by `python -m tests.support.hostile_box PART` (from the
repository root, as any user), which prints one JSON object:

- `memory`: each program in PROGRAMS runs in a box of MEMORY_MB and DISK_MB; for each,
  {"refused": the error of the first refused call or null, "held_mib": the most one of
  its processes wrote where it meant to hold it, "opened": files it opened,
  "killed_for", "returncode", "dip_mib": how far the host's MemAvailable fell while it
  ran, "left_mib": how much lower it stayed after, "shmem_rise_mib" and "shmem_left_mib":
  the same for the host's Shmem, the other way}. MemAvailable moves with whatever else
  the machine runs; Shmem barely.
- `cancel`: reward calls cancelled while their box runs (by a timeout, twice in a row),
  with max_concurrent=2: {"live_after_each": boxes left running when each round of
  cancelled calls returned, "next_s": how long two calls made afterwards took,
  "survivors"}.
- `trainer`: a process running a box is killed (SIGKILL, then SIGTERM): {"SIGKILL":
  boxes left 3 s later, "SIGTERM": the same}.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from looprl.config import CodeRewardConfig
from looprl.rewards.sandbox import Sandbox

MEMORY_MB, DISK_MB = 256, 16
LIMITS = dict(timeout_s=6.0, cpu_time_s=4, memory_mb=MEMORY_MB, max_processes=16, disk_mb=DISK_MB)
TARGET_MIB = 3 * MEMORY_MB  # what each program tries to hold
MARKER = "876.543"  # the sleep of a box that should be gone, found by it in /proc

# Each program prints `held N` (MiB) as it goes and `refused ERROR` where a call fails,
# then sleeps, holding what it has, until its box ends.
_REPORT = (
    "import os, sys, time\n"
    "def held(n):\n    print('held', n, flush=True)\n"
    "def refused(e):\n    print('refused', type(e).__name__, e, flush=True)\n"
)
_LIBC = (
    "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "def failed():\n    return OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))\n"
)
_HOLD = "time.sleep(0.3)\n"  # holding what it has: the budget's watch looks every 50 ms
_CHILDREN = (  # the same program in 15 processes: per-process limits do not add up
    "for _ in range(15):\n    if os.fork() == 0:\n        break\n"
)

PROGRAMS = {
    "memfd files": (
        f"n = 0\ntry:\n    for n in range({TARGET_MIB}):\n"
        "        fd = os.memfd_create('hold')\n        os.write(fd, bytes(1 << 20))\n"
        "        held(n + 1)\nexcept OSError as e:\n    refused(e)\n" + _HOLD
    ),
    "SysV shared memory": _LIBC
    + (
        "libc.shmat.restype = ctypes.c_void_p\n"
        f"for n in range({TARGET_MIB}):\n"
        "    key = libc.shmget(0, 1 << 20, 0o1600)\n"  # IPC_PRIVATE, IPC_CREAT | 0600
        "    if key < 0:\n        refused(failed())\n"
        "        break\n"
        "    address = libc.shmat(key, None, 0)\n"
        "    ctypes.memset(address, 1, 1 << 20)\n"
        "    libc.shmdt(ctypes.c_void_p(address))\n"  # detached: not resident any more
        "    held(n + 1)\n" + _HOLD
    ),
    "SysV message queues": _LIBC
    + (
        "message = ctypes.create_string_buffer(8 + 8192)\nmessage[0] = 1\nkept = 0\n"
        f"while kept < {TARGET_MIB} << 20:\n"
        "    queue = libc.msgget(0, 0o1600)\n"
        "    if queue < 0:\n        refused(failed())\n"
        "        break\n"
        "    while libc.msgsnd(queue, message, 8192, 0o4000) == 0:\n"  # IPC_NOWAIT
        "        kept += 8192\n"
        "    held(kept >> 20)\n" + _HOLD
    ),
    "POSIX shared memory in /dev/shm": (
        "import _posixshmem\nn = 0\ntry:\n"
        f"    for n in range({TARGET_MIB}):\n"
        "        fd = _posixshmem.shm_open(f'/hold{n}', os.O_CREAT | os.O_RDWR, 0o600)\n"
        "        os.write(fd, bytes(1 << 20))\n        held(n + 1)\n"
        "except OSError as e:\n    refused(e)\n" + _HOLD
    ),
    "pipe buffers": "import fcntl\n"
    + _CHILDREN
    + (
        "kept = []\ntry:\n    while True:\n        r, w = os.pipe()\n        kept += [r, w]\n"
        "        try:\n            fcntl.fcntl(w, 1031, 1 << 20)\n"  # F_SETPIPE_SZ
        "        except OSError as e:\n            refused(e)\n"
        "        os.set_blocking(w, False)\n"
        "        try:\n            while True:\n                os.write(w, bytes(65536))\n"
        "        except BlockingIOError:\n            held(65536 * len(kept) // 2 >> 20)\n"
        "except OSError as e:\n    refused(e)\n" + _HOLD
    ),
    "Unix socket buffers": "import socket\n"
    + _CHILDREN
    + (
        "kept = []\nsent = 0\ntry:\n    while True:\n        a, b = socket.socketpair()\n"
        "        kept += [a, b]\n"
        "        try:\n            a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 30)\n"
        "        except OSError as e:\n            refused(e)\n"
        "        for s in (a, b):\n            s.setblocking(False)\n"
        "            try:\n                while True:\n"
        "                    sent += s.send(bytes(65536))\n"
        "            except BlockingIOError:\n                held(sent >> 20)\n"
        "except OSError as e:\n    refused(e)\n" + _HOLD
    ),
    "TCP socket buffers": (
        "import socket\ntry:\n    server = socket.create_server(('127.0.0.1', 0))\n"
        "except OSError as e:\n    refused(e)\n" + _HOLD
    ),
    "many open files": (
        "kept = []\ntry:\n    while len(kept) < 100_000:\n"
        "        kept.append(os.open('/dev/null', os.O_RDONLY))\n"
        "except OSError as e:\n    refused(e)\n"
        "print('open', len(kept), flush=True)\n" + _HOLD
    ),
}


def _meminfo_mib(field: str) -> int:
    """A field of the host's /proc/meminfo: MemAvailable, or Shmem (the pages of tmpfs,
    memfd and shared memory, in all; far less noisy on a shared machine)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) >> 10
    raise RuntimeError(f"no {field} in /proc/meminfo")


def _box_processes(marker: str = MARKER) -> list[int]:
    """Processes whose command line holds `marker`, this one's and its parents' aside."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in (os.getpid(), os.getppid()):
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline and b"hostile_box" not in cmdline:
                found.append(int(entry))
    return found


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


async def memory() -> dict:
    box = Sandbox(CodeRewardConfig(**LIMITS))
    found = {}
    for name, program in PROGRAMS.items():
        before = low = _meminfo_mib("MemAvailable")
        shared = high = _meminfo_mib("Shmem")
        run = asyncio.ensure_future(box.run(_REPORT + program, None))
        while not run.done():
            low = min(low, _meminfo_mib("MemAvailable"))
            high = max(high, _meminfo_mib("Shmem"))
            await asyncio.wait((run,), timeout=0.02)
        result = run.result()
        await asyncio.sleep(0.2)  # the kernel frees a dead box's objects
        lines = result.stdout.splitlines()
        held = [int(line.split()[1]) for line in lines if line.startswith("held ")]
        refusals = [line.split(" ", 1)[1] for line in lines if line.startswith("refused ")]
        opened = [int(line.split()[1]) for line in lines if line.startswith("open ")]
        found[name] = {
            "refused": refusals[0] if refusals else None,
            "held_mib": max(held, default=0),
            "opened": max(opened, default=0),
            "killed_for": result.killed_for,
            "returncode": result.returncode,
            "dip_mib": before - low,
            "left_mib": before - _meminfo_mib("MemAvailable"),
            "shmem_rise_mib": high - shared,
            "shmem_left_mib": _meminfo_mib("Shmem") - shared,
            "error": result.output[-500:] if not result.started else None,
        }
    return {"programs": found, "box": box.describe(), "uid": os.getuid()}


SLEEPER = f"import os\nos.execv('/bin/sleep', ['sleep', '{MARKER}'])\n"


async def cancel() -> dict:
    box = Sandbox(CodeRewardConfig(**{**LIMITS, "timeout_s": 30.0, "max_concurrent": 2}))
    live_after_each = []
    for _ in range(3):  # 2 boxes per round, each call cancelled by its timeout
        calls = [asyncio.wait_for(box.run(SLEEPER, None), 0.7) for _ in range(2)]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(o, TimeoutError) for o in outcomes), outcomes
        live_after_each.append(len(_box_processes()))
    for _ in range(2):  # cancelled twice: the second cancel must not skip the cleanup
        call = asyncio.ensure_future(box.run(SLEEPER, None))
        await asyncio.sleep(0.7)
        call.cancel()
        await asyncio.sleep(0)
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        live_after_each.append(len(_box_processes()))
    start = time.monotonic()
    runs = await asyncio.gather(*(box.run("print('ran')", None) for _ in range(2)))
    next_s = time.monotonic() - start
    assert all(r.stdout == "ran\n" for r in runs), runs
    left = _box_processes()
    _kill_all(left)
    return {"live_after_each": live_after_each, "next_s": next_s, "survivors": len(left)}


async def _hold_a_box() -> None:
    """The trainer: one box that sleeps until this process is killed."""
    await Sandbox(CodeRewardConfig(**{**LIMITS, "timeout_s": 60.0})).run(SLEEPER, None)


def trainer() -> dict:
    found = {}
    for sig in (signal.SIGKILL, signal.SIGTERM):
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.support.hostile_box", "hold-a-box"],
            cwd=Path(__file__).resolve().parents[2],
        )
        deadline = time.monotonic() + 30
        while not _box_processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        started = bool(_box_processes())
        child.send_signal(sig)
        child.wait()
        deadline = time.monotonic() + 3
        while _box_processes() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = _box_processes()
        _kill_all(left)
        found[sig.name] = {"started": started, "left": len(left)}
    return found


if __name__ == "__main__":
    part = sys.argv[1]
    if part == "hold-a-box":
        asyncio.run(_hold_a_box())
    else:
        result = {"memory": lambda: asyncio.run(memory()), "cancel": lambda: asyncio.run(cancel()),
                  "trainer": trainer}[part]()  # fmt: skip
        print(json.dumps(result))
