"""Running untrusted Python (a model's program) in a subprocess that cannot harm the host.

One run: a fresh temporary work dir (removed afterwards) holding the program, started
as `python -I` with a scrubbed environment, under resource limits set before exec
(CPU time, address space, file size, process count) and a wall-clock timeout that
kills everything it started. With `isolation=namespaces` it also runs in new user,
network, PID and mount namespaces (`unshare`): no network interface but a loopback
that is down, its own process tree (all of it killed when the run ends), every mount
read-only except the work dir, no capabilities, and RLIMIT_NPROC counted inside its own
user namespace, so it holds even when looprl runs as root. Without namespaces
(`rlimits`) the program can reach the network and write wherever the user running
looprl can; as root there is no process limit either (the kernel exempts root).

A run passes when the program exits 0 *and* prints the per-run token it read from
stdin after everything else ran: `sys.exit(0)` or `os._exit(0)` halfway is a failure.
The sandbox contains a program; it does not prove the program honest (code that digs
the token out of the interpreter's frames can still forge a pass).

Owns: the isolation probe, one run's limits and its cleanup. Not what is run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from looprl.config import CodeRewardConfig

log = logging.getLogger(__name__)

Status = Literal["passed", "failed", "timed_out", "sandbox_error"]

# Runs inside the namespaces, with their capabilities, before the program: the work dir
# stays writable (its own bind mount), every other mount becomes read-only, then every
# capability is dropped and the program starts. As root it also drops to user nobody
# (the kernel never applies RLIMIT_NPROC to root), reaching the interpreter through a
# bind mount of its prefix inside the work dir (it may live under /root). The shell
# stays the namespace's PID 1 and exits with the program's status (128 + N for signal
# N), which `unshare` passes on.
_INIT = r"""
set -e
box=$1 prefix=$2 user=$3
shift 3
mount --bind "$box" "$box"
if [ -n "$prefix" ]; then
  mkdir "$box/.python"
  mount --bind "$prefix" "$box/.python"
fi
for target in $(awk '{print $5}' /proc/self/mountinfo); do
  [ "$target" = "$box" ] && continue
  mount -o remount,bind,ro "$target" 2>/dev/null || true
done
if [ -w /etc ]; then echo "looprl sandbox: / is still writable" >&2; exit 125; fi
cd "$box"
set +e
if [ -n "$user" ]; then
  setpriv --reuid="$user" --regid="$user" --clear-groups --no-new-privs \
    --bounding-set=-all --inh-caps=-all -- "$@"
else
  setpriv --no-new-privs --bounding-set=-all --inh-caps=-all -- "$@"
fi
exit $?
"""

# The program's entry point: says it started (output without that line means the
# sandbox, not the program, failed), reads the run's token, runs program then test in
# one namespace, and prints the token only if both ran to the end.
_STARTED = b"looprl sandbox: the program starts\n"
_HARNESS = """\
import os, sys
def _main():
    os.write(1, b"looprl sandbox: the program starts\\n")
    token = sys.stdin.readline().strip()
    sys.stdin = open(os.devnull)
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    for name in ("program.py", "test.py"):
        with open(name) as f:
            source = f.read()
        exec(compile(source, name, "exec"), scope)
    sys.stdout.flush()
    os.write(1, ("\\n" + token + "\\n").encode())
_main()
"""


@dataclass(frozen=True)
class SandboxRun:
    status: Status
    returncode: int | None
    output: str  # the program's stdout and stderr, the end of it
    elapsed_s: float


_NOBODY = 65534
_UNSHARE = ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc"]
_UNSHARE += ["--propagation", "private"]


def _command(box: Path, isolation: str) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that run main.py in `box` under `isolation`."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(box), "LANG": "C.UTF-8"}
    python = os.path.realpath(sys.executable)
    if isolation == "rlimits":
        return [python, "-I", "-S", "main.py"], env
    if os.geteuid() != 0:  # a user namespace gives the mounts; this user's processes count
        return [*_UNSHARE, "--map-root-user", "sh", "-c", _INIT, "sh", str(box), "", "", python,
                "-I", "-S", "main.py"], env  # fmt: skip
    prefix = os.path.realpath(sys.base_prefix)
    inside = Path(".python") / Path(python).relative_to(prefix)
    env["LD_LIBRARY_PATH"] = str(box / ".python" / "lib")  # its libpython, by this path
    os.chown(box, _NOBODY, _NOBODY)
    box.parent.chmod(0o711)  # nobody may pass through to the box, not read beside it
    return [*_UNSHARE, "sh", "-c", _INIT, "sh", str(box), prefix, str(_NOBODY), str(inside),
            "-I", "-S", "main.py"], env  # fmt: skip


def namespaces_available() -> str | None:
    """None when this machine runs the namespaced sandbox (probed with a program that
    passes), else why not."""
    if shutil.which("unshare") is None or shutil.which("setpriv") is None:
        return "the `unshare` and `setpriv` commands (util-linux) are not installed"
    workdir = Path(tempfile.mkdtemp(prefix="looprl-sandbox-"))
    try:
        box = workdir / "box"
        box.mkdir()
        for name, text in (("program.py", ""), ("test.py", ""), ("main.py", _HARNESS)):
            (box / name).write_text(text)
        command, env = _command(box, "namespaces")
        done = subprocess.run(
            command, input=b"probe\n", capture_output=True, cwd=box, env=env, timeout=60
        )
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        return f"the namespaced sandbox could not start: {e}"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if done.returncode != 0 or not done.stdout.strip().endswith(b"probe"):
        output = (done.stdout + done.stderr).decode(errors="replace").strip()
        return f"`unshare` failed (exit {done.returncode}): {output[-300:]}"
    return None


class Sandbox:
    """Runs programs under `cfg`'s limits, at most `cfg.max_concurrent` at once.

    `isolation` is what this machine gives: 'namespaces' or 'rlimits' (decided once, at
    construction, and logged when it is less than asked)."""

    def __init__(self, cfg: CodeRewardConfig):
        self.cfg = cfg
        self._slots = asyncio.Semaphore(cfg.max_concurrent)
        self.isolation = "rlimits"
        if cfg.isolation != "rlimits":
            why = namespaces_available()
            if why is None:
                self.isolation = "namespaces"
                log.info(
                    "The code sandbox runs programs in their own user, network, PID and "
                    "mount namespaces (no network, read-only file system but their work dir)"
                )
            elif cfg.isolation == "namespaces":
                raise RuntimeError(
                    f"reward.code.isolation=namespaces, but {why}; run where user namespaces "
                    "are allowed, or set reward.code.isolation=rlimits to accept a program "
                    "that can reach the network and write the user's files"
                )
            else:
                log.warning(
                    "The code sandbox runs without namespaces (%s): programs get resource "
                    "limits and a temporary directory, but can reach the network and write "
                    "wherever this user can%s. Set reward.code.isolation=namespaces to refuse "
                    "to run like this",
                    why,
                    ", with no process limit (root)" if os.geteuid() == 0 else "",
                )

    async def run(self, program: str, test: str) -> SandboxRun:
        """Run `program` then `test` in one interpreter; never raises for what they do."""
        async with self._slots:
            start = time.monotonic()
            workdir = Path(tempfile.mkdtemp(prefix="looprl-sandbox-"))
            try:
                return await self._run_in(workdir, program, test, start)
            except (OSError, ValueError) as e:
                error = f"{type(e).__name__}: {e}"
                return SandboxRun("sandbox_error", None, error, time.monotonic() - start)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)

    async def _run_in(self, workdir: Path, program: str, test: str, start: float) -> SandboxRun:
        box = workdir / "box"  # the program's; the output file beside it is not
        box.mkdir()
        (box / "program.py").write_text(program)
        (box / "test.py").write_text(test)
        (box / "main.py").write_text(_HARNESS)
        command, env = _command(box, self.isolation)
        token = secrets.token_hex(16)
        with open(workdir / "output", "w+b") as output:
            process = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.PIPE,
                stdout=output,
                stderr=subprocess.STDOUT,
                cwd=box,
                env=env,
                preexec_fn=self._limit,
                start_new_session=True,
            )
            timed_out = False
            try:
                process.stdin.write(token.encode() + b"\n")
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    await process.stdin.drain()
                    process.stdin.close()
                await asyncio.wait_for(process.wait(), self.cfg.timeout_s)
            except TimeoutError:
                timed_out = True
            finally:
                # Not after a namespaced run ended: its PID namespace died with it, and
                # its reaped process group id may already belong to someone else.
                if process.returncode is None or self.isolation == "rlimits":
                    _kill_group(process.pid)
                await process.wait()
            output.seek(0)
            started = output.read(len(_STARTED)) == _STARTED
            output.seek(max(0, output.seek(0, os.SEEK_END) - 4000))
            text = output.read().decode(errors="replace")
        elapsed = time.monotonic() - start
        rc = process.returncode
        # RLIMIT_CPU ends a busy loop with SIGXCPU (reported as 128 + N by the init shell).
        if timed_out or rc in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
            return SandboxRun("timed_out", rc, text, elapsed)
        if not started:  # unshare, the mounts or the interpreter failed before the program
            return SandboxRun("sandbox_error", rc, text, elapsed)
        passed = rc == 0 and text.rstrip("\n").rsplit("\n", 1)[-1] == token
        return SandboxRun("passed" if passed else "failed", rc, text, elapsed)

    def _limit(self) -> None:
        """In the child, before exec: the limits every process it starts inherits."""
        cfg = self.cfg
        memory = cfg.memory_mb * 2**20
        limits = {
            resource.RLIMIT_CPU: (cfg.cpu_time_s, cfg.cpu_time_s + 1),
            resource.RLIMIT_AS: (memory, memory),
            resource.RLIMIT_FSIZE: (cfg.max_output_bytes, cfg.max_output_bytes),
            resource.RLIMIT_NPROC: (cfg.max_processes, cfg.max_processes),
            resource.RLIMIT_CORE: (0, 0),
        }
        for kind, value in limits.items():
            resource.setrlimit(kind, value)


def _kill_group(pid: int) -> None:
    """SIGKILL the run's process group: with namespaces, unshare's death takes its PID
    namespace down (--kill-child); without, processes that left the group survive until
    their CPU limit (documented)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
