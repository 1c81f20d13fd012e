"""Hang classification on hand-written faulthandler dumps (the format of a real one:
Python 3.11, torch 2.13, two gloo ranks; paths shortened)."""

from __future__ import annotations

import pytest

from looprl.diagnostics.hangs import Frame, Place, classify_hang, locate, parse_threads, short_path

SITE = "/venv/lib/python3.11/site-packages"
STDLIB = "/usr/lib/python3.11"
C10D = f"{SITE}/torch/distributed/distributed_c10d.py"
LOGGER = f"{SITE}/torch/distributed/c10d_logger.py"
TRAIN = "/work/train.py"

# As faulthandler wrote it for a rank waiting in all_reduce, with an idle helper thread
# listed first (faulthandler lists the newest thread first, the main thread last).
RANK_IN_ALL_REDUCE = f"""\
Thread 0x00007fae4bfff6c0 (most recent call first):
  File "{STDLIB}/threading.py", line 982 in run
  File "{STDLIB}/threading.py", line 1045 in _bootstrap_inner
  File "{STDLIB}/threading.py", line 1002 in _bootstrap

Current thread 0x00007fae746a8b80 (most recent call first):
  File "{C10D}", line 3252 in all_reduce
  File "{LOGGER}", line 83 in wrapper
  File "{TRAIN}", line 13 in step
  File "{TRAIN}", line 40 in main
  File "{STDLIB}/multiprocessing/process.py", line 108 in run
  File "<string>", line 1 in <module>
"""


def thread(*frames: tuple[str, int, str], current: bool = False) -> str:
    """One thread of a dump; frames innermost first, as (file, line, function)."""
    head = "Current thread" if current else "Thread"
    lines = [f"{head} 0x00007f0000000001 (most recent call first):"]
    lines += [f'  File "{file}", line {line} in {function}' for file, line, function in frames]
    return "\n".join(lines) + "\n"


def dump(*threads: str) -> str:
    return "\n".join(threads)


def in_collective(name: str, line: int, *, via: str | None = None) -> str:
    """A main thread waiting in collective `name` called from train.py:`line`;
    `via`: an inner collective that `name` calls (all_gather_object -> all_gather)."""
    inner = [(C10D, 3100, via), (LOGGER, 83, "wrapper")] if via else []
    return thread(*inner, (C10D, 2900, name), (LOGGER, 83, "wrapper"), (TRAIN, line, "step"))


SLEEPING = thread((TRAIN, 21, "step"), (TRAIN, 40, "main"))
CLEANUP = thread((C10D, 2200, "destroy_process_group"), (TRAIN, 55, "main"))
WATCHDOG = thread(
    (f"{SITE}/looprl/diagnostics/stacks.py", 77, "signal_stacks"),
    (f"{SITE}/looprl/diagnostics/watchdog.py", 120, "_watch"),
    (f"{STDLIB}/threading.py", 982, "run"),
    current=True,
)


def test_parse_threads_keeps_dump_order_and_innermost_first():
    threads = parse_threads(RANK_IN_ALL_REDUCE)
    assert [len(t) for t in threads] == [3, 6]
    assert threads[1][0] == Frame(C10D, 3252, "all_reduce")
    assert threads[1][2] == Frame(TRAIN, 13, "step")
    assert parse_threads("no dump here\n") == []


def test_a_collective_is_named_with_its_callers_line_past_torchs_wrappers():
    assert locate(RANK_IN_ALL_REDUCE) == Place("collective", "all_reduce", Frame(TRAIN, 13, "step"))
    assert (
        locate(RANK_IN_ALL_REDUCE).describe() == "waits in all_reduce at /work/train.py:13 in step"
    )


def test_the_collective_the_user_called_is_named_not_the_one_it_calls():
    place = locate(in_collective("all_gather_object", 30, via="all_gather"))
    assert (place.function, place.frame.line) == ("all_gather_object", 30)


def test_a_collective_in_a_worker_thread_wins_over_the_main_threads_place():
    worker = in_collective("broadcast", 31)
    main = thread((f"{STDLIB}/threading.py", 1112, "join"), (TRAIN, 60, "main"))
    assert locate(dump(worker, main)).function == "broadcast"


def test_the_watchdogs_own_thread_is_never_the_place():
    place = locate(dump(WATCHDOG, SLEEPING))
    assert place == Place("elsewhere", frame=Frame(TRAIN, 21, "step"))
    assert place.describe() == "is outside any collective, at /work/train.py:21 in step"
    assert locate(WATCHDOG) == Place("elsewhere")  # nothing but the watchdog itself


def test_cleanup_and_exited():
    assert locate(CLEANUP) == Place("cleanup", "destroy_process_group", Frame(TRAIN, 55, "main"))
    assert locate(None) == Place("exited")


def test_one_rank_outside_the_collective_the_other_waits_in():
    hang = classify_hang({"rank 0": RANK_IN_ALL_REDUCE, "rank 1": dump(WATCHDOG, SLEEPING)})
    assert hang.pattern == "outside_collective"
    assert hang.summary == (
        "rank 0 waits in all_reduce at /work/train.py:13 in step while rank 1 is outside any "
        "collective, at /work/train.py:21 in step: rank 1 has not reached the collective "
        "(still working, stuck, or on a branch that skips it). The stacks below show where."
    )


def test_ranks_that_exited_or_sit_in_cleanup_while_others_wait():
    hang = classify_hang(
        {"rank 0": in_collective("all_reduce", 13), "rank 1": None, "rank 2": CLEANUP}
    )
    assert hang.pattern == "exited_or_cleanup"
    assert hang.summary.startswith(
        "rank 1 has exited, rank 2 is in cleanup (destroy_process_group at /work/train.py:55 in "
        "main) while rank 0 waits in all_reduce at /work/train.py:13 in step: a rank that "
        "stops early"
    )
    assert "Find out why rank 1 and rank 2 stopped" in hang.summary
    # Exited or in cleanup outranks "outside a collective": the stopped rank explains it.
    mixed = classify_hang({"rank 0": in_collective("barrier", 9), "rank 1": None, "r2": SLEEPING})
    assert mixed.pattern == "exited_or_cleanup"


def test_ranks_in_different_collectives():
    hang = classify_hang(
        {
            "rank 0": in_collective("all_reduce", 13),
            "rank 1": in_collective("broadcast", 17),
            "rank 2": in_collective("all_reduce", 13),
        }
    )
    assert hang.pattern == "different_collectives"
    assert hang.summary.startswith(
        "The ranks wait in different collectives: rank 0 and rank 2 wait in all_reduce at "
        "/work/train.py:13 in step, rank 1 waits in broadcast at /work/train.py:17 in step. "
        "Every rank must call the same collectives in the same order"
    )


def test_every_rank_in_the_same_collective_points_at_the_network():
    hang = classify_hang({"rank 0": RANK_IN_ALL_REDUCE, "rank 1": in_collective("all_reduce", 13)})
    assert hang.pattern == "same_collective"
    assert hang.summary.startswith(
        "Every rank waits in the same collective: rank 0 and rank 1 wait in all_reduce at "
        "/work/train.py:13 in step. Each one reached it"
    )
    assert "NCCL_SOCKET_IFNAME" in hang.summary


@pytest.mark.parametrize(
    "stacks",
    [
        {"driver": dump(WATCHDOG, SLEEPING)},
        {"rank 0": SLEEPING, "rank 1": None},  # one left, the other is not in a collective
    ],
)
def test_no_collective(stacks):
    hang = classify_hang(stacks)
    assert hang.pattern == "no_collective"
    assert hang.summary.startswith("No process waits in a collective: ")
    assert "is outside any collective, at /work/train.py:21 in step" in hang.summary


def test_a_dump_without_python_frames_is_said_so():
    hang = classify_hang({"rank 0": RANK_IN_ALL_REDUCE, "rank 1": "(no stacks: timed out)"})
    assert hang.pattern == "outside_collective"
    assert "rank 1 is outside any collective (its stack shows no Python frame)" in hang.summary


def test_short_path():
    assert short_path(C10D) == "torch/distributed/distributed_c10d.py"
    assert short_path(f"{STDLIB}/threading.py") == "threading.py"
    assert short_path(TRAIN) == TRAIN
