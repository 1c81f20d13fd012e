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


END_MARKER = "# looprl: end of stacks\n"
_installed: Path | None = None


def install_stack_dump() -> Path:
    """SIGUSR1 -> every thread's Python stack appended to `stack_file(os.getpid())`,
    then `END_MARKER` once the main thread runs Python again (so a reader knows the dump
    is whole). Installed once per process: a second `signal.signal` would replace
    faulthandler's handler with ours."""
    global _installed
    if _installed is not None:
        return _installed
    path = stack_file(os.getpid())
    handle = path.open("a")  # kept open for the life of the process, as faulthandler needs

    def mark_end(signum, frame) -> None:
        os.write(handle.fileno(), END_MARKER.encode())

    signal.signal(signal.SIGUSR1, mark_end)
    # faulthandler dumps at once from the C handler, then chains to ours (run later, on
    # the main thread, between bytecodes): the marker always follows the whole dump
    faulthandler.register(signal.SIGUSR1, file=handle, all_threads=True, chain=True)
    _installed = path
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
    size, steady_since = before, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now_size = path.stat().st_size if path.exists() else 0
        if now_size > before:
            with path.open() as f:
                f.seek(before)
                text = f.read()
            if END_MARKER in text:
                return text[: text.index(END_MARKER)]
            # no marker yet: the main thread may be stuck outside Python, so a dump
            # whose size has held for 2 s is taken as whole
            if now_size != size:
                size, steady_since = now_size, time.monotonic()
            elif time.monotonic() - steady_since >= 2.0:
                return text
    if size > before:
        return text  # a dump still growing at the deadline: what there is
    raise TimeoutError(
        f"process {pid} wrote no stacks to {path} within {timeout_s} s: it is not a looprl "
        "process, or it is stuck outside Python (install py-spy to see native frames)"
    )
