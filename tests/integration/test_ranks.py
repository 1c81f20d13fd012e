"""Two real gloo ranks on this CPU: a hang is reported, a failure stops both, nothing is
left behind. The rank functions live here, at module level, so spawned ranks import
them by name."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from looprl.config import DiagnosticsConfig
from looprl.diagnostics.watchdog import registered
from looprl.scheduling.ranks import RankFailed
from tests.support.ranks import Rank, launch_ranks

HANG_TIMEOUT_S = 3.0
DIAGNOSTICS = DiagnosticsConfig(hang_timeout_s=HANG_TIMEOUT_S, collective_timeout_s=60)
ROOT = Path(__file__).resolve().parents[2]


def _line_of(marker: str) -> int:
    """The line of this file that ends with `# marker` (where a stack must point)."""
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.endswith(f"# {marker}"))


def late_rank(rank: Rank) -> None:
    """Rank 0 waits in all_reduce while rank 1 sleeps outside it until a hang report is
    written; then rank 1 joins and both finish (asking for stacks must not break it)."""
    total = torch.tensor([float(rank.rank + 1)])
    rank.watchdog.beat()  # the last progress either rank makes before the hang
    (rank.run_dir / f"beat-{rank.rank}").write_text(repr(time.time()))
    if rank.rank == 0:
        dist.all_reduce(total)  # WAITS
    else:
        deadline = time.monotonic() + HANG_TIMEOUT_S + 30
        while not list((rank.run_dir / "hangs").glob("hang-*.txt")):
            assert time.monotonic() < deadline, "no hang report was written"
            time.sleep(0.1)  # SLEEPS
        dist.all_reduce(total)
    (rank.run_dir / f"sum-{rank.rank}").write_text(str(total.item()))


def failing_rank(rank: Rank, rank_0_in: str) -> None:
    """Rank 1 raises; rank 0 waits in all_reduce, or in a long sleep that only a signal
    ends (gloo's 'connection closed' cannot reach it there)."""
    (rank.run_dir / f"started-{rank.rank}").write_text(repr(time.time()))
    if rank.rank == 1:
        time.sleep(0.5)
        raise ValueError("rank 1 failed on purpose")  # RAISES
    if rank_0_in == "all_reduce":
        dist.all_reduce(torch.ones(1))
    else:
        time.sleep(120)


def sleeping_rank(rank: Rank) -> None:
    (rank.run_dir / f"started-{rank.rank}").write_text(repr(time.time()))
    time.sleep(120)


def _no_rank_alive(run_dir: Path) -> bool:
    ranks = [p for p in registered(run_dir) if p.role == "rank"]
    return len(ranks) == 2 and not any(p.alive() for p in ranks)


def test_a_rank_outside_the_collective_the_other_waits_in_is_reported(tmp_path, capfd):
    launch_ranks(late_rank, 2, run_dir=tmp_path, diagnostics=DIAGNOSTICS, backend="gloo")

    reports = list((tmp_path / "hangs").glob("hang-*.txt"))
    assert len(reports) == 1, reports  # two stalled ranks, one report
    report = reports[0].read_text()
    beats = [float((tmp_path / f"beat-{r}").read_text()) for r in (0, 1)]
    written = reports[0].stat().st_mtime
    assert min(beats) + HANG_TIMEOUT_S <= written <= max(beats) + HANG_TIMEOUT_S + 10, (
        written - min(beats)
    )
    here = __file__
    summary = (
        f"rank 0 waits in all_reduce at {here}:{_line_of('WAITS')} in late_rank while rank 1 "
        f"is outside any collective, at {here}:{_line_of('SLEEPS')} in late_rank: rank 1 has "
        "not reached the collective"
    )
    assert summary in report
    assert "==== rank 0 (pid" in report and "==== rank 1 (pid" in report  # both stacks
    assert report.count("distributed_c10d.py") >= 1 and report.count("in late_rank") >= 2
    said = capfd.readouterr().err
    assert re.search(r"Hang: rank [01] made no progress for \d+\.\d s", said), said
    assert summary in said and str(reports[0]) in said
    # The run went on: the stack requests did not break the collective.
    assert [(tmp_path / f"sum-{r}").read_text() for r in (0, 1)] == ["3.0", "3.0"]
    assert _no_rank_alive(tmp_path)


@pytest.mark.parametrize("rank_0_in", ["all_reduce", "sleep"])
def test_an_exception_on_rank_1_stops_both_with_its_traceback(tmp_path, rank_0_in):
    with pytest.raises(RankFailed) as failed:
        launch_ranks(
            failing_rank,
            2,
            run_dir=tmp_path,
            diagnostics=DIAGNOSTICS,
            args=(rank_0_in,),
            backend="gloo",
        )
    done = time.time()
    error = failed.value
    raised_at = json.loads((tmp_path / "ranks" / "rank-1.json").read_text())["time"]
    assert done - raised_at < 5.0, done - raised_at  # within seconds, not a timeout
    assert error.rank == 1
    assert all(code != 0 for code in error.exit_codes.values()), error.exit_codes
    text = str(error)
    assert text.startswith("rank 1 of 2 raised (rank 0 ")
    assert f'{__file__}", line {_line_of("RAISES")}, in failing_rank' in text
    assert text.rstrip().endswith("ValueError: rank 1 failed on purpose")
    assert "Connection closed" not in text  # rank 0's later error is not the one shown
    assert _no_rank_alive(tmp_path)


def test_ranks_die_with_their_launcher(tmp_path):
    """SIGKILL to the launcher (no cleanup runs in it) still leaves no rank behind."""
    program = (
        "from pathlib import Path; from tests.support.ranks import launch_ranks; "
        "from tests.integration.test_ranks import sleeping_rank, DIAGNOSTICS; "
        f"launch_ranks(sleeping_rank, 2, run_dir=Path({str(tmp_path)!r}), "
        "diagnostics=DIAGNOSTICS, backend='gloo')"
    )
    launcher = subprocess.Popen([sys.executable, "-c", program], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"started-{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.1)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 5
        while not _no_rank_alive(tmp_path):
            assert time.monotonic() < deadline, "a rank outlived its launcher"
            time.sleep(0.1)
    finally:
        launcher.kill()
        for p in registered(tmp_path):
            if p.alive():
                os.kill(p.pid, signal.SIGKILL)
