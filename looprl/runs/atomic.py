"""Atomic file writes: a reader of a run file sees the whole old file or the whole new one.

Owns `atomic_write` (and `atomic_write_text`, its text form): the content goes into a
hidden temporary file beside the target (`.<name>.<pid>.<n>.tmp`, so a folder's readers
that match names, such as `list_steps` or `*.json`, never pick it up), which then
replaces the target with `os.replace`; on any failure the temporary file is removed
and the target is left as it was. With `fsync=True` the file is fsynced before the
rename and its folder after, so the new content survives a crash of the machine too
(checkpoints need that; files a run rewrites every step do not pay for it).

Also `fsync_file` and `fsync_dir`, for writers of whole folders (checkpoint.py), and
the files the run writes through it: trajectory step files (trajectories.py), frames
GIFs (looprl/envs/frames.py), metrics.jsonl when a resume rewinds it (metrics.py), the
checkpoints' `latest` pointer (checkpoint.py) and the process registry entries
(looprl/diagnostics/watchdog.py). Folders written whole are `looprl.models`' business.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path

_counter = itertools.count()  # temporary names unique across this process's threads


def atomic_write(path: str | Path, write: Callable[[Path], None], *, fsync: bool = False) -> Path:
    """Write `path` atomically: `write(tmp)` writes the whole content to `tmp`, a path
    in the same folder (which is created when missing), then `tmp` replaces `path`.
    When `write` (or the rename) raises, `tmp` is removed and the error goes on; `path`
    keeps its old content or stays absent. `fsync`: fsync the file before the rename
    and the folder after. Returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{next(_counter)}.tmp")
    try:
        write(tmp)
        if fsync:
            fsync_file(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if fsync:
        fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | Path, text: str, *, fsync: bool = False) -> Path:
    """`text` (UTF-8) as the whole of `path`, atomically (see `atomic_write`)."""
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), fsync=fsync)


def fsync_file(path: Path) -> None:
    """Flush `path`'s content to the disk."""
    with Path(path).open("rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Flush folder `path`'s entries (a rename or a new file in it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
