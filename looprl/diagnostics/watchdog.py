"""Hang watchdog: a thread in every looprl process that reports when progress stops.

Owns `HangWatchdog` and the run's process registry, `<name>.json` in the run's
processes folder (`RunPaths.processes`; pid, role, rank, host, start time, each entry
written atomically through looprl/runs/atomic.py), which tells a watchdog whom to ask
for stacks and who has exited. Does not own what counts as progress (the caller's
`beat()`s) nor the reading of stacks (`hangs.py`). Its functions take the run
directory, its root or its RunPaths.

Concurrency contract. `beat()` may be called from any thread (two float stores). The
watchdog's daemon thread wakes every `poll_s`; when the last beat is older than
`timeout_s` and this stall has not been reported, it takes `.lock` in the run's hangs
folder (`RunPaths.hangs`; flock: the run's processes report one at a time) and, unless
a report was written after its last beat (one report per stall, whichever process
stalled first), asks every registered live process on this host for its stacks
(SIGUSR1 -> faulthandler, which answers even from inside a C++ collective), classifies
them, writes `hang-<time>-<name>.txt` there and logs the summary. With `abort`, it then
stops every other registered process (SIGTERM, SIGKILL after `STOP_GRACE_S`) and its
own with exit code 1. `stop()` ends the thread (joined); a failure inside the thread is
logged and the thread goes on watching.
"""

from __future__ import annotations

import contextlib
import faulthandler
import fcntl
import json
import logging
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from looprl.config import DiagnosticsConfig
from looprl.diagnostics.hangs import classify_hang, locate
from looprl.diagnostics.stacks import install_stack_dump, signal_stacks
from looprl.runs.atomic import atomic_write_text
from looprl.runs.paths import RunPaths

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0  # abort: SIGTERM, then SIGKILL for those still alive after this


@dataclass(frozen=True)
class Registered:
    """One process of the run, as it registered itself."""

    name: str
    pid: int
    role: str
    rank: int | None
    host: str
    start_ticks: str | None  # /proc/<pid>/stat start time: a reused pid is not this process

    @property
    def label(self) -> str:
        return label(self.name, self.role, self.rank)

    def alive(self) -> bool:
        stat = _proc_stat(self.pid)
        if stat is None:
            return _pid_exists(self.pid)  # no /proc (not Linux): trust the pid
        state, ticks = stat
        return state not in ("Z", "X") and (self.start_ticks in (None, ticks))


class HangWatchdog:
    """Reports (with `hang_abort`, also stops) the run when `beat()` has not been called
    for `diagnostics.hang_timeout_s` seconds; 0 turns it off. `busy(since)` (the
    driver's: the failure budget's `activity`) says what finished since a time.monotonic()
    without being progress: rollouts that fail, say. A stall with such activity is named
    as that in a warning, not reported as a hang."""

    def __init__(
        self,
        run_dir: Path | RunPaths,
        name: str,
        diagnostics: DiagnosticsConfig,
        *,
        role: str = "driver",
        rank: int | None = None,
        busy: Callable[[float], str | None] | None = None,
    ):
        self.paths, self.name = RunPaths.of(run_dir), name
        self.run_dir = self.paths.root
        self.timeout_s, self.abort = diagnostics.hang_timeout_s, diagnostics.hang_abort
        self.role, self.rank, self.busy = role, rank, busy
        self.poll_s = min(1.0, self.timeout_s / 4)
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.beat()
        self._reported_beat: float | None = None

    @property
    def label(self) -> str:
        return label(self.name, self.role, self.rank)

    def beat(self) -> None:
        """Progress was made."""
        self._last_beat, self._last_beat_wall = time.monotonic(), time.time()

    def start(self) -> HangWatchdog:
        """Register this process in the run and start watching."""
        if self.timeout_s <= 0:
            return self
        install_stack_dump()  # registered processes are asked for stacks with SIGUSR1
        register(self.paths, self.name, role=self.role, rank=self.rank)
        self.beat()
        self._thread = threading.Thread(target=self._watch, name="looprl-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def __enter__(self) -> HangWatchdog:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _watch(self) -> None:  # hangs.WATCHDOG_FRAME: this thread is never the hang
        while not self._stopped.wait(self.poll_s):
            beat = self._last_beat
            if time.monotonic() - beat < self.timeout_s or self._reported_beat == beat:
                continue
            if self.busy is not None and (activity := self.busy(beat)) is not None:
                log.warning(
                    "No hang: %s made no training progress for %.0f s, but %s: it is busy "
                    "with rollouts that do not reach training (not the engine's doing when "
                    "they fail; see the rollout errors above).",
                    self.label,
                    time.monotonic() - beat,
                    activity,
                )
                self.beat()  # busy is not hung: watch again from now
                continue
            self._reported_beat = beat  # one report per stall
            try:
                path = self.report()
            except Exception:
                log.exception("The hang watchdog of %s could not write its report", self.name)
                continue
            if path is not None and self.abort:
                self._abort_run()

    def report(self) -> Path | None:
        """Write and log a hang report, unless one was written since our last beat."""
        hangs = self.paths.hangs
        hangs.mkdir(parents=True, exist_ok=True)
        with (hangs / ".lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            last = hangs / "last-report"
            if last.exists() and float(last.read_text() or 0) >= self._last_beat_wall:
                return None  # another process reported this stall
            stalled_s = time.monotonic() - self._last_beat
            stamp = datetime.now().strftime("%Y%m%d-%H%M%S.%f")[:-3]
            path = hangs / f"hang-{stamp}-{self.name}.txt"
            text, summary = self._report_text(stalled_s)
            path.write_text(text)
            last.write_text(repr(time.time()))
        log.error(
            "Hang: %s made no progress for %.1f s (diagnostics.hang_timeout_s=%g). %s The "
            "stack of every thread of every process is in %s",
            self.label,
            stalled_s,
            self.timeout_s,
            summary,
            path,
        )
        return path

    def _report_text(self, stalled_s: float) -> tuple[str, str]:
        processes = registered(self.paths)
        stacks = collect_stacks(processes)
        ranks = [p for p in processes if p.rank is not None and p.label in stacks]
        judged = ranks or [p for p in processes if p.label in stacks]
        hang = classify_hang({p.label: stacks[p.label] for p in judged})
        lines = [
            f"Hang report {time.strftime('%Y-%m-%d %H:%M:%S')}: {self.label} (pid "
            f"{os.getpid()}) made no progress for {stalled_s:.1f} s "
            f"(diagnostics.hang_timeout_s={self.timeout_s:g}).",
            "",
            hang.summary,
            "",
            "Processes:",
        ]
        for p in processes:
            where = locate(stacks[p.label]).describe() if p.label in stacks else _elsewhere(p)
            lines.append(f"  {p.label}: {where} (pid {p.pid} on {p.host})")
        for p in processes:
            lines += ["", f"==== {p.label} (pid {p.pid}) ===="]
            lines.append((stacks[p.label] or "(exited)") if p.label in stacks else _elsewhere(p))
        return "\n".join(lines) + "\n", hang.summary

    def _abort_run(self) -> None:
        others = [p for p in registered(self.paths) if p.pid != os.getpid() and _local(p)]
        log.error(
            "Stopping the run (diagnostics.hang_abort=true): %s and this process (%s).",
            ", ".join(f"{p.label} (pid {p.pid})" for p in others) or "no other process",
            self.label,
        )
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in others if p.alive()]
            for p in alive:
                _kill(p.pid, sig)
            deadline = time.monotonic() + STOP_GRACE_S
            while any(p.alive() for p in alive) and time.monotonic() < deadline:
                time.sleep(0.1)
        logging.shutdown()  # flush the log files before leaving without cleanup
        os._exit(1)


# ---- the run's process registry -----------------------------------------------------


def register(run_dir: Path | RunPaths, name: str, *, role: str, rank: int | None) -> Path:
    """Enter this process in the run's registry as `name` (replacing an entry of that
    name), atomically: a watchdog reading the registry sees the whole entry or none."""
    stat = _proc_stat(os.getpid())
    entry = {
        "name": name,
        "pid": os.getpid(),
        "role": role,
        "rank": rank,
        "host": socket.gethostname(),
        "start_ticks": stat[1] if stat else None,
    }
    return atomic_write_text(RunPaths.of(run_dir).processes / f"{name}.json", json.dumps(entry))


def registered(run_dir: Path | RunPaths) -> list[Registered]:
    """The run's processes, ranks in rank order first."""
    folder = RunPaths.of(run_dir).processes
    found = [Registered(**json.loads(p.read_text())) for p in folder.glob("*.json")]
    return sorted(found, key=lambda p: (p.rank is None, p.rank or 0, p.name))


def forget_processes(run_dir: Path | RunPaths, pattern: str = "*") -> None:
    """Drop registrations left by an earlier run in this run dir (they would read as
    exited processes of this one)."""
    for path in RunPaths.of(run_dir).processes.glob(f"{pattern}.json"):
        path.unlink(missing_ok=True)


def label(name: str, role: str, rank: int | None) -> str:
    """How reports name a process: 'rank 1', or its name."""
    return f"{role} {rank}" if rank is not None else name


def collect_stacks(processes: list[Registered]) -> dict[str, str | None]:
    """label -> faulthandler dump, None for an exited process; processes on other hosts
    are left out (their own watchdog reports them). Asked all at once."""
    local = [p for p in processes if _local(p)]
    own = {p.label: _own_stacks() for p in local if p.pid == os.getpid()}  # before the pool
    others = [p for p in local if p.pid != os.getpid()]

    def one(p: Registered) -> str | None:
        if not p.alive():
            return None
        try:
            return signal_stacks(p.pid)
        except (TimeoutError, ProcessLookupError) as e:
            return None if not p.alive() else f"(no stacks: {e})"

    with ThreadPoolExecutor(max_workers=max(1, len(others))) as pool:
        asked = dict(zip([p.label for p in others], pool.map(one, others), strict=True))
    return {p.label: own[p.label] if p.label in own else asked[p.label] for p in local}


def _own_stacks() -> str:
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read()


def _elsewhere(p: Registered) -> str:
    return f"runs on host {p.host}, not this one: its own watchdog reports it"


def _local(p: Registered) -> bool:
    return p.host == socket.gethostname()


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks) from /proc, None without it or the process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    return fields[0], fields[19]


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
