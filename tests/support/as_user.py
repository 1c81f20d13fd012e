"""Running a command of this checkout as an unprivileged user, from a test run as root.

The user is created once (`useradd --system`, no home). The interpreter, the venv and
the checkout may sit under directories only root may enter (/root, a `mktemp -d`
clone): the command runs in a private mount namespace where each such directory is
covered by a tmpfs holding bind mounts of just the paths it needs, so the user reaches
those and nothing else of the directory. Nothing changes outside that namespace.
"""

from __future__ import annotations

import json
import os
import pwd
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

TEST_USER = "looprl-sandbox-test"


def unprivileged_user() -> tuple[int, int]:
    """(uid, gid) of the test user, created if missing (needs root)."""
    try:
        entry = pwd.getpwnam(TEST_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
             TEST_USER],
            check=True, capture_output=True,
        )  # fmt: skip
        entry = pwd.getpwnam(TEST_USER)
    return entry.pw_uid, entry.pw_gid


def _closed_ancestor(path: Path) -> Path | None:
    """The highest directory above `path` that others may not enter, if any."""
    for parent in reversed(path.parents):
        if parent != Path("/") and not parent.stat().st_mode & stat.S_IXOTH:
            return parent
    return None


def run_as_user(argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float):
    """subprocess.run(argv) as the test user, with the interpreter, venv and `cwd`
    reachable; stdout and stderr captured as text."""
    uid, gid = unprivileged_user()
    needed = {Path(os.path.realpath(p)) for p in (sys.base_prefix, sys.prefix, cwd)}
    script = ["set -e", "stage=$(mktemp -d)"]
    covered: dict[Path, list[Path]] = {}
    for path in needed:
        closed = _closed_ancestor(path)
        if closed is not None:
            covered.setdefault(closed, []).append(path)
    for index, (closed, paths) in enumerate(covered.items()):
        view = f"$stage/{index}"
        quoted = shlex.quote(str(closed))
        script += [f"mkdir {view}", f"mount --bind {quoted} {view}",
                   f"mount -t tmpfs -o mode=0755 looprl-test {quoted}"]  # fmt: skip
        for path in paths:
            inside = shlex.quote(str(closed / path.relative_to(closed)))
            source = f"{view}/{shlex.quote(str(path.relative_to(closed)))}"
            script += [f"mkdir -p {inside}", f"mount --bind {source} {inside}"]
    script.append(
        f"exec setpriv --reuid={uid} --regid={gid} --clear-groups -- "
        + " ".join(shlex.quote(a) for a in argv)
    )
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(script)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


ROOT = os.geteuid() == 0
REPO = Path(__file__).resolve().parents[2]

# Both ways a test runs a box: as whoever runs the tests, and (as root) as the test user.
USERS = [
    pytest.param(False, id="this user"),
    pytest.param(
        True,
        id="an unprivileged user",
        marks=pytest.mark.skipif(not ROOT, reason="creating the unprivileged user needs root"),
    ),
]


def run_module_json(module: str, args: list[str], as_user: bool, timeout: float) -> dict:
    """`python -m module *args` from the checkout, as this user or the test user, with a
    bare environment; its stdout parsed as one JSON object."""
    argv = [sys.executable, "-m", module, *args]
    env = {"PATH": os.environ["PATH"], "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}
    if as_user:
        done = run_as_user(argv, cwd=REPO, env=env, timeout=timeout)
    else:
        done = subprocess.run(
            argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
        )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)
