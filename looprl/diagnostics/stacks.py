"""Stacks on demand: every looprl process can be asked for the stack of each thread.

Owns: `install_stack_dump()` (called by the CLI at start: SIGUSR1 makes the process
append every Python thread's stack to `stack_file(pid)`, via `faulthandler`, without
stopping it), `write_pid()` (the driver's pid in its run dir, so a run dir names its
process), and `dump_stacks()` behind `looprl debug stacks PID|RUN_DIR` (py-spy when it
is installed, which also sees native frames, else the signal: `signal_stacks()`, whose
faulthandler format the hang watchdog parses).
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

PID_FILE = "driver.pid"


def stack_file(pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"looprl-stacks-{pid}.txt"


def install_stack_dump() -> Path:
    """SIGUSR1 -> every thread's Python stack appended to `stack_file(os.getpid())`."""
    path = stack_file(os.getpid())
    handle = path.open("a")  # kept open for the life of the process, as faulthandler needs
    faulthandler.register(signal.SIGUSR1, file=handle, all_threads=True, chain=False)
    return path


def write_pid(run_dir: Path) -> None:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / PID_FILE).write_text(str(os.getpid()))


def resolve_pid(target: str) -> int:
    """A pid, or a run dir whose driver.pid names one; ValueError says which is wrong."""
    if target.isdigit():
        return int(target)
    pid_file = Path(target) / PID_FILE
    if not pid_file.is_file():
        raise ValueError(f"{target!r} is neither a pid nor a run dir with {PID_FILE}")
    return int(pid_file.read_text().strip())


def dump_stacks(pid: int, timeout_s: float = 5.0) -> str:
    """The stacks of process `pid`'s threads, as text."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        raise ValueError(f"no process with pid {pid} (it has exited)") from None
    py_spy = shutil.which("py-spy")
    if py_spy:
        done = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True)
        if done.returncode == 0:
            return done.stdout
    return signal_stacks(pid, timeout_s)


def signal_stacks(pid: int, timeout_s: float = 5.0) -> str:
    """Process `pid`'s faulthandler dump, asked for with SIGUSR1 (the process must have
    called `install_stack_dump`: SIGUSR1 ends one that has not)."""
    path = stack_file(pid)
    before = path.stat().st_size if path.exists() else 0
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.1)
        if path.exists() and path.stat().st_size > before:
            time.sleep(0.2)  # let the dump finish
            with path.open() as f:
                f.seek(before)
                return f.read()
    raise TimeoutError(
        f"process {pid} wrote no stacks to {path} within {timeout_s} s: it is not a looprl "
        "process, or it is stuck outside Python (install py-spy to see native frames)"
    )
