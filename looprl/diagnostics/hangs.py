"""What a hang looks like: where each process waits, and the pattern, in one sentence.

Owns `classify_hang(stacks)`, a pure function from each process's `faulthandler` dump
(`None` for a process that has exited) to a `Hang`: where each process is (`Place`:
waiting in a torch.distributed collective, in cleanup, exited, or elsewhere) and which
of five patterns they form, with a summary a user can act on:

- `exited_or_cleanup`: some ranks exited or sit in `destroy_process_group` while others
  wait in a collective (a rank stopped early: an error, or fewer steps);
- `outside_collective`: some ranks wait in a collective while others are outside any
  (still working, stuck, or on a branch that skips it);
- `different_collectives`: the ranks wait in different collectives (called in a
  different order on different ranks);
- `same_collective`: every rank waits in the same collective (each reached it, so the
  network or a mismatch inside the collective keeps it from completing);
- `no_collective`: nobody waits in a collective (the stall is in ordinary code).

A collective is recognised by its frame in `torch/distributed/distributed_c10d.py`; the
place named is its caller (the user's file:line), found by skipping torch.distributed's
own wrappers. Does not own collecting the stacks or writing the report (`watchdog.py`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "reduce",
        "broadcast",
        "broadcast_object_list",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_gather_coalesced",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "monitored_barrier",
        "gather",
        "gather_object",
        "scatter",
        "scatter_object_list",
        "send",
        "recv",
        "send_object_list",
        "recv_object_list",
        "batch_isend_irecv",
        "init_process_group",  # the rendezvous: every rank must arrive
        "new_group",
    }
)
CLEANUP = frozenset({"destroy_process_group"})
C10D_FILE = "torch/distributed/distributed_c10d.py"
WATCHDOG_FRAME = ("looprl/diagnostics/watchdog.py", "_watch")  # its own thread: never the hang

Pattern = Literal[
    "exited_or_cleanup",
    "outside_collective",
    "different_collectives",
    "same_collective",
    "no_collective",
]

_HEADER = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-fA-F]+")
_FRAME = re.compile(r'^\s+File "(?P<file>.+)", line (?P<line>\d+) in (?P<function>.+?)\s*$')


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{short_path(self.file)}:{self.line} in {self.function}"


@dataclass(frozen=True)
class Place:
    """Where one process is. `frame`: the caller of the collective or of
    destroy_process_group, else the innermost frame of the main thread."""

    kind: Literal["exited", "collective", "cleanup", "elsewhere"]
    function: str | None = None  # the collective's or cleanup's name
    frame: Frame | None = None

    def describe(self) -> str:
        """E.g. 'waits in all_reduce at train.py:12 in step'."""
        at = f" at {self.frame}" if self.frame else ""
        if self.kind == "exited":
            return "has exited"
        if self.kind == "collective":
            return f"waits in {self.function}{at}"
        if self.kind == "cleanup":
            return f"is in cleanup ({self.function}{at})"
        if self.frame is None:
            return "is outside any collective (its stack shows no Python frame)"
        return f"is outside any collective, at {self.frame}"


@dataclass(frozen=True)
class Hang:
    pattern: Pattern
    summary: str
    places: dict[str, Place]


def parse_threads(text: str) -> list[list[Frame]]:
    """A faulthandler dump -> each thread's frames, innermost first, in dump order (the
    main thread is last: faulthandler lists the newest thread first)."""
    threads: list[list[Frame]] = []
    for line in text.splitlines():
        if _HEADER.match(line):
            threads.append([])
        elif threads and (m := _FRAME.match(line)):
            threads[-1].append(Frame(m["file"], int(m["line"]), m["function"]))
    return threads


def locate(stack: str | None) -> Place:
    """Where a process is, from its faulthandler dump (None: it has exited).

    Any thread in a collective wins (a trainer may run its step in a worker thread),
    then any thread in cleanup, else the main thread's innermost frame.
    """
    if stack is None:
        return Place("exited")
    threads = [t for t in parse_threads(stack) if not _is_watchdog(t)]
    for names, kind in ((COLLECTIVES, "collective"), (CLEANUP, "cleanup")):
        for frames in threads:
            found = _outermost_c10d(frames, names)
            if found is not None:
                return Place(kind, frames[found].function, _caller(frames, found))
    main = threads[-1] if threads else []
    return Place("elsewhere", frame=main[0] if main else None)


def classify_hang(stacks: dict[str, str | None]) -> Hang:
    """Name the pattern formed by the processes' stacks (name -> dump, None: exited)."""
    places = {name: locate(stack) for name, stack in stacks.items()}
    by_kind: dict[str, list[str]] = {"exited": [], "collective": [], "cleanup": [], "elsewhere": []}
    for name, place in places.items():
        by_kind[place.kind].append(name)
    waiting = {name: places[name] for name in by_kind["collective"]}
    stopped = by_kind["exited"] + by_kind["cleanup"]
    if waiting and stopped:
        who = _join(stopped)
        summary = (
            f"{_each(stopped, places)} while {_waits(waiting)}: a rank that stops early (an "
            "error, or fewer steps than the others) leaves the rest waiting in their next "
            f"collective. Find out why {who} stopped (its error, above or in its log), and "
            "make every rank call the same collectives."
        )
        return Hang("exited_or_cleanup", summary, places)
    if waiting and by_kind["elsewhere"]:
        outside = by_kind["elsewhere"]
        summary = (
            f"{_waits(waiting)} while {_each(outside, places)}: {_join(outside)} "
            f"{'has' if len(outside) == 1 else 'have'} not reached the collective (still "
            "working, stuck, or on a branch that skips it). The stacks below show where."
        )
        return Hang("outside_collective", summary, places)
    if len({p.function for p in waiting.values()}) > 1:
        summary = (
            f"The ranks wait in different collectives: {_waits(waiting)}. Every rank must "
            "call the same collectives in the same order; look for a branch on the rank or "
            "on the data before these calls."
        )
        return Hang("different_collectives", summary, places)
    if waiting:
        summary = (
            f"Every rank waits in the same collective: {_waits(waiting)}. Each one reached "
            "it, so the collective itself does not complete: check the network between the "
            "ranks (NCCL_DEBUG=INFO, NCCL_SOCKET_IFNAME, firewalls) and that the tensors "
            "agree in shape and dtype; diagnostics.collective_timeout_s bounds the wait."
        )
        return Hang("same_collective", summary, places)
    summary = (
        f"No process waits in a collective: {_each(list(places), places)}. The stall is in "
        "ordinary code; the stacks below show where."
    )
    return Hang("no_collective", summary, places)


def short_path(path: str) -> str:
    """A library file from where its package starts; any other path as it is."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    m = re.search(r"/lib/python3\.\d+/(.+)$", path)
    return m[1] if m else path


def _is_watchdog(frames: list[Frame]) -> bool:
    file, function = WATCHDOG_FRAME
    return any(f.file.endswith(file) and f.function == function for f in frames)


def _outermost_c10d(frames: list[Frame], names: frozenset[str]) -> int | None:
    """Index of the outermost c10d frame named in `names` (all_gather_object calls
    all_gather: the user called the outer one)."""
    found = None
    for i, f in enumerate(frames):
        if f.file.endswith(C10D_FILE) and f.function in names:
            found = i
    return found


def _caller(frames: list[Frame], index: int) -> Frame | None:
    """The first frame outward of `index` that is not torch.distributed's own."""
    for f in frames[index + 1 :]:
        if "torch/distributed/" not in f.file:
            return f
    return None


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _each(names: list[str], places: dict[str, Place]) -> str:
    return ", ".join(f"{name} {places[name].describe()}" for name in names)


def _waits(waiting: dict[str, Place]) -> str:
    """Ranks grouped by collective and call site: 'rank 0 and rank 2 wait in all_reduce
    at train.py:12 in step'."""
    groups: dict[tuple[str | None, Frame | None], list[str]] = {}
    for name, place in waiting.items():
        groups.setdefault((place.function, place.frame), []).append(name)
    parts = []
    for (function, frame), names in groups.items():
        verb = "waits" if len(names) == 1 else "wait"
        parts.append(f"{_join(names)} {verb} in {function}" + (f" at {frame}" if frame else ""))
    return ", ".join(parts)
