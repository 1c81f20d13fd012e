"""Ranks on this machine for tests: N processes in one torch.distributed group that fail
fast (the library's ranks are Ray actors, scheduling/ray.py; these run a function of a
test in each rank, e.g. the data-parallel trainer against one process).

`launch_ranks(fn, world_size, run_dir=...)` spawns `world_size` processes. Each joins a
process group (gloo on CPU, nccl with a GPU per rank) through a TCPStore the launcher
hosts, with `diagnostics.collective_timeout_s` as the collective timeout; answers
SIGUSR1 with its stacks; runs a `HangWatchdog` registered as `rank N`; then calls
`fn(Rank, *args)`, which beats the watchdog when it makes progress.

Fail fast. A rank whose `fn` raises writes its traceback to `<run_dir>/ranks/rank-N.json`
and leaves with `os._exit(1)`: no `destroy_process_group`, no interpreter teardown,
where a process group's destructor can wait on peers that will never come. The
launcher, woken by that exit, sends SIGTERM to every other rank at once (SIGKILL after
`STOP_GRACE_S`) and raises `RankFailed` holding the original traceback: the earliest
failure, so that a peer's later "Connection closed by peer" is not what the user reads.
A rank never outlives its launcher (PR_SET_PDEATHSIG=SIGKILL; call `launch_ranks` from a
thread that lives until it returns, as it blocks until then).

Why not `torch.multiprocessing.spawn`: on a failure it reports whichever exited process
comes first in its wait list (with gloo, rank 0's "Connection closed by peer" follows rank
1's error by ~50 ms, so both can be ready and rank 0 is listed first), a failing rank
leaves through `sys.exit` and interpreter teardown, and its ranks get SIGINT when the
launcher dies, which Python acts on only once a blocking C++ call (a collective) returns.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.multiprocessing import _prctl_pr_set_pdeathsig

from looprl.config import DiagnosticsConfig
from looprl.diagnostics.watchdog import HangWatchdog, forget_processes
from looprl.scheduling.ranks import RankFailed, join_group

log = logging.getLogger(__name__)

STOP_GRACE_S = 3.0  # after SIGTERM, the time a rank gets before SIGKILL
HOST = "127.0.0.1"


@dataclass(frozen=True)
class Rank:
    """What `fn` gets in each rank process."""

    rank: int
    world_size: int
    device: torch.device
    run_dir: Path
    watchdog: HangWatchdog  # call watchdog.beat() after each unit of progress (a step)


def launch_ranks(
    fn: Callable[..., None],
    world_size: int,
    *,
    run_dir: Path,
    diagnostics: DiagnosticsConfig | None = None,
    args: tuple = (),
    backend: str | None = None,
) -> None:
    """Run `fn(Rank, *args)` in `world_size` processes; return when every one has
    returned, raise `RankFailed` as soon as one fails. `fn` must be importable by name
    (a module-level function), as spawned processes import it. `backend`: 'gloo' or
    'nccl'; by default nccl when every rank gets a GPU, gloo when there is no GPU."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    diagnostics = diagnostics or DiagnosticsConfig()
    backend = backend or default_backend(world_size)
    run_dir = Path(run_dir)
    errors = run_dir / "ranks"
    errors.mkdir(parents=True, exist_ok=True)
    for old in errors.glob("rank-*.json"):
        old.unlink()
    forget_processes(run_dir, "rank-*")
    store = dist.TCPStore(HOST, 0, world_size, is_master=True, wait_for_workers=False)
    spawn = multiprocessing.get_context("spawn")
    processes = [
        spawn.Process(
            target=_run_rank,
            args=(rank, world_size, fn, args, run_dir, store.port, backend, diagnostics),
            name=f"looprl-rank-{rank}",
        )
        for rank in range(world_size)
    ]
    started = time.time()
    try:
        for p in processes:
            p.start()
        seen = _wait_for_first_failure(processes)
        if seen:
            stopped = {rank for rank, p in enumerate(processes) if p.is_alive()}
            _stop(processes)
            raise first_failure(
                {rank: p.exitcode for rank, p in enumerate(processes)},
                stopped,
                {int(f.stem[5:]): json.loads(f.read_text()) for f in errors.glob("rank-*.json")},
                seen,
                _latest_hang_report(run_dir, started),
            )
    finally:
        _stop(processes)  # Ctrl-C or an error here: no rank is left behind


def default_backend(world_size: int) -> str:
    if not torch.cuda.is_available():
        return "gloo"
    gpus = torch.cuda.device_count()
    if gpus < world_size:
        raise ValueError(
            f"world_size={world_size} ranks but {gpus} GPU(s) on this machine: use at most "
            f"{gpus} ranks, or backend='gloo' to run them on the CPU"
        )
    return "nccl"


# ---- in the rank process ----------------------------------------------------------


def _run_rank(
    rank: int,
    world_size: int,
    fn: Callable[..., None],
    args: tuple,
    run_dir: Path,
    port: int,
    backend: str,
    diagnostics: DiagnosticsConfig,
) -> None:
    _prctl_pr_set_pdeathsig(signal.SIGKILL)  # die with the launcher, even inside C++
    if os.getppid() != multiprocessing.parent_process().pid:
        os._exit(1)  # the launcher died before the line above
    logging.basicConfig(format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s")
    logging.getLogger("looprl").setLevel(logging.INFO)
    watchdog = HangWatchdog(run_dir, f"rank-{rank}", diagnostics, role="rank", rank=rank)
    try:
        watchdog.start()
        timeout = timedelta(seconds=diagnostics.collective_timeout_s)
        store = dist.TCPStore(HOST, port, world_size, is_master=False, timeout=timeout)
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        join_group(store, rank, world_size, backend, device, diagnostics.collective_timeout_s)
        fn(Rank(rank, world_size, device, run_dir, watchdog), *args)
        watchdog.beat()
        dist.destroy_process_group()
    except SystemExit as e:
        if e.code not in (None, 0):
            _leave(run_dir, rank)
    except BaseException:
        _leave(run_dir, rank)
    watchdog.stop()


def _leave(run_dir: Path, rank: int) -> None:
    """Record the traceback being handled for the launcher, and exit now."""
    record = {"time": time.time(), "traceback": traceback.format_exc()}
    (run_dir / "ranks" / f"rank-{rank}.json").write_text(json.dumps(record))
    os._exit(1)


# ---- in the launcher ----------------------------------------------------------------


def _wait_for_first_failure(processes: list) -> dict[int, float]:
    """Block until every rank exited 0 ({}) or some exited otherwise: {rank: when seen}."""
    running = {p.sentinel: rank for rank, p in enumerate(processes)}
    while running:
        ready = multiprocessing.connection.wait(list(running))
        seen, failed = time.time(), {}
        for sentinel in ready:
            rank = running.pop(sentinel)
            processes[rank].join()
            if processes[rank].exitcode != 0:
                failed[rank] = seen
        if failed:
            return failed
    return {}


def _stop(processes: list) -> None:
    """SIGTERM to every live rank, SIGKILL to those alive `STOP_GRACE_S` later; reap all."""
    alive = [p for p in processes if p.pid is not None and p.is_alive()]
    for p in alive:
        with contextlib.suppress(ProcessLookupError):
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            log.warning("Rank process %d did not stop on SIGTERM; killing it", p.pid)
            p.kill()
        p.join()


def first_failure(
    exit_codes: dict[int, int],
    stopped: set[int],
    records: dict[int, dict],
    seen: dict[int, float],
    hang_report: Path | None = None,
) -> RankFailed:
    """The earliest failure as a RankFailed. `records`: rank -> {"time", "traceback"} of
    ranks that raised; `seen`: when the launcher saw the first failed ranks exit (the
    time of a failure without a record: a signal, `os._exit`); `stopped`: ranks the
    launcher stopped, which did not fail on their own."""
    failures = [(record["time"], rank, record["traceback"]) for rank, record in records.items()]
    failures += [
        (seen.get(rank, math.inf), rank, None)
        for rank, code in exit_codes.items()
        if code != 0 and rank not in stopped and rank not in records
    ]
    _, rank, tb = min(failures)
    others = "; ".join(
        f"rank {r} {_exit_status(code, r in stopped)}"
        for r, code in exit_codes.items()
        if r != rank
    )
    world = len(exit_codes)
    if tb is not None:
        message = f"rank {rank} of {world} raised ({others}). Its traceback:\n\n{tb}"
    else:
        code = exit_codes[rank]
        hint = (
            "SIGKILL often means the kernel's out-of-memory killer (see `dmesg`)"
            if code == -signal.SIGKILL
            else "its output above says why"
        )
        message = (
            f"rank {rank} of {world} {_exit_status(code, False)} before it could report a Python "
            f"error ({others}); {hint}"
        )
    if hang_report is not None:
        message += f"\nThe hang watchdog wrote a report during this run: {hang_report}"
    return RankFailed(message, rank, exit_codes, tb)


def _exit_status(code: int, stopped: bool) -> str:
    if stopped:
        return "was stopped"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return "finished" if code == 0 else f"exited with code {code}"


def _latest_hang_report(run_dir: Path, since: float) -> Path | None:
    reports = [p for p in (run_dir / "hangs").glob("hang-*.txt") if p.stat().st_mtime >= since]
    return max(reports, key=lambda p: p.stat().st_mtime) if reports else None
