"""Which failure the launcher shows when several ranks end: the earliest, by hand-made
records (the processes themselves are in tests/integration/test_ranks.py)."""

from __future__ import annotations

import signal
from pathlib import Path

from tests.support.ranks import first_failure

ORIGINAL = 'Traceback (most recent call last):\n  File "train.py", line 9\nValueError: bad row\n'
PEER = "Traceback (most recent call last):\nRuntimeError: Connection closed by peer\n"


def test_the_earliest_traceback_wins_over_a_peers_later_connection_error():
    # Rank 1 raised; rank 0 saw the connection close 50 ms later; rank 2 was stopped.
    failed = first_failure(
        {0: 1, 1: 1, 2: -signal.SIGTERM},
        stopped={2},
        records={0: {"time": 100.05, "traceback": PEER}, 1: {"time": 100.0, "traceback": ORIGINAL}},
        seen={0: 100.06, 1: 100.06},
    )
    assert failed.rank == 1 and failed.traceback == ORIGINAL
    assert str(failed) == (
        "rank 1 of 3 raised (rank 0 exited with code 1; rank 2 was stopped). Its traceback:"
        f"\n\n{ORIGINAL}"
    )
    assert failed.exit_codes == {0: 1, 1: 1, 2: -15}


def test_a_rank_killed_by_a_signal_is_the_failure_when_seen_first():
    failed = first_failure(
        {0: 1, 1: -signal.SIGKILL},
        stopped=set(),
        records={0: {"time": 100.2, "traceback": PEER}},
        seen={1: 100.1},
    )
    assert failed.rank == 1 and failed.traceback is None
    assert str(failed) == (
        "rank 1 of 2 was killed by SIGKILL before it could report a Python error (rank 0 "
        "exited with code 1); SIGKILL often means the kernel's out-of-memory killer (see `dmesg`)"
    )


def test_an_exit_without_a_record_seen_later_loses_to_a_recorded_error():
    failed = first_failure(
        {0: 1, 1: 3},
        stopped=set(),
        records={0: {"time": 100.0, "traceback": ORIGINAL}},
        seen={0: 100.1},  # rank 1 exited with 3 after that, unseen at first
        hang_report=Path("runs/x/hangs/hang-1.txt"),
    )
    assert failed.rank == 0
    assert str(failed).endswith(
        "\nThe hang watchdog wrote a report during this run: runs/x/hangs/hang-1.txt"
    )
    alone = first_failure({0: 0, 1: 3}, stopped=set(), records={}, seen={1: 5.0})
    assert str(alone) == (
        "rank 1 of 2 exited with code 3 before it could report a Python error (rank 0 "
        "finished); its output above says why"
    )
