"""Running untrusted Python (a model's program) in a box that cannot harm the host, and
bringing back data, never a verdict.

The box (`isolation=bubblewrap`, the default) is Debian's bubblewrap: a root file system
of its own holding only the read-only interpreter and system libraries (`/usr`, the
Python prefix), a size-capped tmpfs as its work dir (`/work`, also its `/tmp` and
`/dev/shm`), its own `/proc` of its own PID namespace, a network namespace with nothing
in it (no host Unix sockets, abstract ones included), no `$HOME`, `/run`, `/etc`, host
`/tmp` or run directory, an empty environment, and no capabilities. Nothing started in
it outlives it: its PID namespace dies with it. The same box is built as root and as a
normal user; what differs is how the box's processes get a user of their own:

- as a normal user, bubblewrap makes a user namespace (unprivileged);
- as root, bubblewrap runs privileged and the box drops to a user id of its own, one per
  concurrent box (`_BoxUids`, claimed with a lock file), so the kernel counts each box's
  processes apart (it never limits root's) and no box can signal another.

Budgets are per box: `max_processes` (RLIMIT_NPROC, counted in the box's own user
namespace or for its own user id, set by the harness inside), `memory_mb` (summed every
50 ms over the box's processes, the box killed beyond it: their resident memory, plus
each pipe and socket open in them at the most its kernel buffers hold; also each
process's address space), `disk_mb` (the tmpfs, where POSIX shared memory lands too),
64 open files per process (in the box), `cpu_time_s` per process and a wall clock (`timeout_s`) that
kills the box. What would hold memory outside these is refused (EPERM) by a seccomp
filter built with libseccomp (seccomp.py): memfd files, System V shared memory,
message queues and semaphores, POSIX message queues, io_uring, inotify, vmsplice,
growing a pipe or a socket buffer, and sockets other than Unix ones. Without the filter
no box starts. cgroups are not used: this code has only run where no cgroup v2 memory
or pids controller was delegated.

A box never outlives its `Sandbox.run`: cancelled (a rollout's timeout, the controller
closing), the call kills the box and waits until it is gone before it lets go of its
slot and user id; if looprl dies, bubblewrap dies with it (`--die-with-parent`), and
the box with bubblewrap.

Where bubblewrap cannot make a box (not installed, user namespaces forbidden, no
libseccomp), the sandbox refuses to start with the reason and the fix.
`isolation=unisolated` is the explicit opt-in to running programs without a box, as the
user running looprl, with resource limits, the same filter (sockets of any family
allowed), an empty environment and a temporary work dir only; it warns loudly and stops
far less (docs/security.md; tests/support/hostile.py lists what gets out).

What comes back is data: whether looprl's harness started (said on a pipe the harness
closes before the program runs; if not, the box failed: a sandbox error), the records
the harness wrote on a second pipe (the values a test asked for, see
looprl/rewards/cases.py; a program that writes there or drains it only fails itself),
the program's stdout and the tail of its stderr. The program's exit status and output
are inputs to the verdict, which is made outside the box (looprl/rewards/code.py).

Owns: building the box, one run's budgets and its cleanup. Not what is run or judged.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

from looprl.config import CodeRewardConfig
from looprl.rewards.harness import HARNESS
from looprl.rewards.seccomp import REFUSAL_PROBE, ProcessFilter, filter_pipe, refusal_filter

log = logging.getLogger(__name__)

_RESULTS_CAP = 1 << 20  # bytes of results kept; a box that writes more has failed
_OUTPUT_TAIL = 4000  # characters of stderr kept for the logs and the viewer
_POLL_S = 0.05
_OPEN_FILES = 64  # RLIMIT_NOFILE of each process: what its pipes and sockets can hold
# What the budget charges for each pipe and socket open in the box: the most their
# kernel buffers hold at the default size the box cannot raise (16 pages of a pipe; a
# Unix socket's send buffer, net.core.wmem_default, and one message past it).
_PIPE_BYTES = 16 * os.sysconf("SC_PAGE_SIZE")
_SOCKET_BYTES = 2 * int(Path("/proc/sys/net/core/wmem_default").read_text())
T = TypeVar("T")


@dataclass(frozen=True)
class BoxRun:
    """What one run of the box gave. Data for the verdict, never the verdict."""

    started: bool  # looprl's harness ran (False: the box itself failed)
    timed_out: bool  # the wall clock or the CPU limit ended it
    returncode: int | None
    records: list[dict]  # the results pipe's JSON lines, in order ([] if any was not JSON)
    stdout: str  # the program's stdout (a stdin/stdout case's answer), at most max_output_bytes
    output: str  # the end of its stderr (and stdout when a script ran)
    elapsed_s: float
    killed_for: str | None = None  # "memory", "results": a budget the box went past


def bubblewrap_missing() -> str | None:
    """None where bubblewrap makes a working box here (probed with a real run), else
    why not, with the fix."""
    if shutil.which("bwrap") is None:
        return (
            "Debian's bubblewrap is not installed (no `bwrap` on PATH); install it "
            "(`apt-get install bubblewrap`, or your distribution's package)"
        )
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        return "util-linux's `setpriv` is not installed (the box drops root with it)"
    try:
        refusals = refusal_filter(unix_sockets_only=True)
    except RuntimeError as e:
        return f"the box's system call filter cannot be built: {e}"
    filter_fd = filter_pipe(refusals)
    try:
        with _BoxUids().claim() if os.geteuid() == 0 else contextlib.nullcontext() as uid:
            command = _box_command(_system_mounts(), 1 << 20, uid, filter_fd=filter_fd)
            done = subprocess.run(
                [*command, "-c", REFUSAL_PROBE],
                capture_output=True,
                timeout=60,
                pass_fds=(filter_fd,),
            )
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
        return f"bubblewrap could not start: {e}"
    finally:
        os.close(filter_fd)
    error = done.stderr.decode(errors="replace").strip()[-300:]
    if "filter is not in force" in error:
        return f"the box's system call filter did not hold: {error}"
    if done.returncode != 0:
        return (
            f"bubblewrap failed to make a box (exit {done.returncode}: {error}); where user "
            "namespaces are forbidden, allow them (`sysctl kernel.unprivileged_userns_clone=1`"
            "; on Ubuntu, an AppArmor profile for bwrap), or run looprl as root"
        )
    return None


def _system_mounts() -> list[str]:
    """bubblewrap arguments for the system's read-only interpreter and libraries: /usr,
    the merged-/usr links (or directories) beside it, and Python's prefix."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    prefix = os.path.realpath(sys.base_prefix)
    if not prefix.startswith("/usr/"):
        args += ["--ro-bind", prefix, prefix]
    return args


def _box_command(
    mounts: list[str],
    disk_bytes: int,
    uid: int | None,
    filter_fd: int,
    info_fd: int | None = None,
) -> list[str]:
    """The argv that starts the interpreter in a new box (the harness or probe follows):
    `mounts` from `_system_mounts`, `uid` the box's own user id when looprl runs as root,
    `filter_fd` a pipe holding `refusal_filter`'s program (bubblewrap applies it last,
    before the interpreter starts)."""
    args = ["bwrap", "--die-with-parent", "--new-session", "--clearenv"]
    for name, value in (("PATH", "/usr/bin:/bin"), ("HOME", "/work"), ("LANG", "C.UTF-8"),
                        ("TMPDIR", "/tmp")):  # fmt: skip
        args += ["--setenv", name, value]
    args += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
    args += ["--unshare-cgroup-try"]
    if uid is None:  # a normal user: a user namespace, and none nested in it
        args += ["--unshare-user", "--disable-userns"]
    args += mounts
    args += ["--proc", "/proc", "--dir", "/dev"]
    for device in ("null", "zero", "random", "urandom"):
        args += ["--dev-bind-try", f"/dev/{device}", f"/dev/{device}"]
    args += ["--symlink", "/proc/self/fd", "/dev/fd"]
    for number, name in enumerate(("stdin", "stdout", "stderr")):
        args += ["--symlink", f"/proc/self/fd/{number}", f"/dev/{name}"]
    args += ["--perms", "1777", "--size", str(disk_bytes), "--tmpfs", "/work"]
    for inside, outside in ((".tmp", "/tmp"), (".shm", "/dev/shm")):
        args += ["--perms", "1777", "--dir", f"/work/{inside}", "--symlink", f"/work/{inside}",
                 outside]  # fmt: skip
    args += ["--chdir", "/work", "--remount-ro", "/", "--seccomp", str(filter_fd)]
    if info_fd is not None:
        args += ["--info-fd", str(info_fd)]
    if uid is not None:  # root: the box's processes run as a user id of their own
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "setpriv",
                 f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs",
                 "--bounding-set=-all", "--inh-caps=-all", "--"]  # fmt: skip
    return [*args, os.path.realpath(sys.executable), "-I", "-S"]


class _BoxUids:
    """User ids for boxes started by root, one per box running on this machine: a box
    claims one by locking its file (the lock goes with the process that held it), so
    looprl processes side by side never share one."""

    FIRST = 1_900_000_000
    COUNT = 4096

    def __init__(self) -> None:
        self.dir = Path(tempfile.gettempdir()) / "looprl-sandbox-uids"
        self.dir.mkdir(mode=0o700, exist_ok=True)
        if self.dir.stat().st_uid != 0 or self.dir.is_symlink():
            raise RuntimeError(f"{self.dir} is not root's own directory; remove it")

    @contextlib.contextmanager
    def claim(self) -> Iterator[int]:
        start = random.randrange(self.COUNT)
        for n in range(self.COUNT):
            uid = self.FIRST + (start + n) % self.COUNT
            fd = os.open(self.dir / str(uid), os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                yield uid
            finally:
                os.close(fd)  # releases the lock
            return
        raise RuntimeError(f"all {self.COUNT} sandbox user ids are in use on this machine")


class SandboxUnavailable(RuntimeError):
    """No box can be made here (and isolation=unisolated was not asked for), or the system
    call filter cannot be installed (either isolation)."""


class Sandbox:
    """Runs programs in boxes under `cfg`'s budgets, at most `cfg.max_concurrent` at once.

    The isolation is decided once, here: bubblewrap must work (else this raises with the
    reason and the fix), or `cfg.isolation='unisolated'` was asked for."""

    def __init__(self, cfg: CodeRewardConfig):
        self.cfg = cfg
        self._slots = asyncio.Semaphore(cfg.max_concurrent)
        self.isolation = cfg.isolation
        self.as_root = os.geteuid() == 0
        self._uids = _BoxUids() if self.as_root and cfg.isolation == "bubblewrap" else None
        self._mounts = _system_mounts()  # the same for every box
        self._unboxed_filter: ProcessFilter | None = None
        if self.isolation == "bubblewrap":
            why = bubblewrap_missing()  # its probe runs under the box's filter
            if why is not None:
                raise SandboxUnavailable(
                    f"reward.type=code runs the model's programs in a box, and none can be "
                    f"made here: {why}. To run them without isolation anyway (they can then "
                    "read this user's files and reach the network), set "
                    "reward.code.isolation=unisolated"
                )
            self._refusals = refusal_filter(unix_sockets_only=True)
            log.info("The code sandbox runs programs in %s", self.describe())
        else:
            try:  # no box, but the same refusals (sockets of any family allowed)
                self._unboxed_filter = ProcessFilter(refusal_filter(unix_sockets_only=False))
                self._unboxed_filter.check()
            except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                raise SandboxUnavailable(
                    "reward.code.isolation=unisolated still refuses the system calls that "
                    "would hold memory outside reward.code.memory_mb (a seccomp filter), and "
                    f"that filter cannot be installed here: {e}"
                ) from None
            log.warning(
                "reward.code.isolation=unisolated: the model's programs run WITHOUT a box, "
                "as %s. They get resource limits, an empty environment and a temporary work "
                "dir, but can read whatever this user can (its files, this process's "
                "environment), reach the network, write outside their work dir, start "
                "processes past any cap and leave them running. Use it only for programs you "
                "would run yourself",
                "root" if self.as_root else "this user",
            )

    def describe(self) -> str:
        """One line: what isolates a program here."""
        if self.isolation == "unisolated":
            return "no box (reward.code.isolation=unisolated)"
        who = "a user id of its own per box (root)" if self.as_root else "a user namespace"
        return (
            f"a bubblewrap box ({who}; no network, its own PID namespace and read-only root, "
            f"a {self.cfg.disk_mb} MiB work dir, {self.cfg.memory_mb} MiB and "
            f"{self.cfg.max_processes} processes per box)"
        )

    async def run(
        self, program: str, script: str | None = None, stdin: str = "", data: str | None = None
    ) -> BoxRun:
        """Run `program`, then `script` in its scope (or, without a script, `program`
        alone reading `stdin`). Never raises for what the program does."""
        async with self._slots:
            start = time.monotonic()
            with contextlib.ExitStack() as stack:
                workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="looprl-")))
                uid = stack.enter_context(self._uids.claim()) if self._uids else None
                try:  # cancelled, the box is killed and gone before the slot and uid are
                    run = self._run(workdir, uid, program, script, stdin, start, data)
                    return await _to_the_end(run)
                except (OSError, ValueError, RuntimeError, subprocess.SubprocessError) as e:
                    error = f"{type(e).__name__}: {e}"
                    return BoxRun(False, False, None, [], "", error, time.monotonic() - start)

    async def _run(self, workdir: Path, uid: int | None, program: str, script: str | None,
                   stdin: str, start: float, data: str | None) -> BoxRun:  # fmt: skip
        cfg = self.cfg
        task = {"program": program, "script": script, "data": data,
                "max_processes": self._process_cap()}  # fmt: skip
        (workdir / "task").write_text(json.dumps(task))
        (workdir / "stdin").write_text(stdin)
        files = {
            name: open(workdir / name, mode)  # noqa: SIM115 (closed below)
            for name, mode in (
                ("task", "rb"),
                ("stdin", "rb"),
                ("stdout", "w+b"),
                ("stderr", "w+b"),
            )  # fmt: skip
        }
        started_r, started_w = os.pipe()
        results_r, results_w = os.pipe()
        info_r, info_w = os.pipe()
        os.set_blocking(info_r, False)
        os.set_blocking(started_r, False)
        passed = [started_w, results_w, info_w]  # closed here once the child has them
        try:
            if self.isolation == "bubblewrap":
                passed.append(filter_pipe(self._refusals))
                command = _box_command(self._mounts, cfg.disk_mb << 20, uid,
                                       filter_fd=passed[-1], info_fd=info_w)  # fmt: skip
                env = {}
            else:
                command = [os.path.realpath(sys.executable), "-I", "-S"]
                env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "LANG": "C.UTF-8",
                       "TMPDIR": str(workdir)}  # fmt: skip
                (workdir / "box").mkdir()
            fd_task = files["task"].fileno()
            process = await asyncio.create_subprocess_exec(
                *command,
                "-c",
                HARNESS,
                str(fd_task),
                str(started_w),
                str(results_w),
                stdin=files["stdin"],
                stdout=files["stdout"] if script is None else files["stderr"],
                stderr=files["stderr"],
                cwd=workdir / "box" if self.isolation == "unisolated" else workdir,
                env=env,
                pass_fds=(fd_task, *passed),
                preexec_fn=self._child_setup,
                start_new_session=True,
            )
        except BaseException:  # cancelled here, asyncio killed bubblewrap: its box goes too
            init_pid = _read_init_pid(info_r, bytearray())
            for fd in (started_r, results_r, info_r, *passed):
                os.close(fd)
            for f in files.values():
                f.close()
            if init_pid is not None:
                await _gone(init_pid)
            raise
        for fd in passed:
            os.close(fd)
        results_pipe = os.fdopen(results_r, "rb", buffering=0)
        reader = asyncio.create_task(_read_capped(results_pipe, _RESULTS_CAP))
        try:
            killed_for, timed_out = await self._watch(process, info_r, reader)
            try:  # unisolated, a process that left the group may hold the pipe open
                results, overflow = await asyncio.wait_for(reader, 2.0)
            except TimeoutError:
                results, overflow = b"", False
            started = False
            with contextlib.suppress(BlockingIOError):
                started = os.read(started_r, 64) == b"started\n"
            stdout = _read_head(files["stdout"], cfg.max_output_bytes)
            output = _read_tail(files["stderr"], _OUTPUT_TAIL)
        finally:
            reader.cancel()
            results_pipe.close()
            os.close(info_r)
            os.close(started_r)
            for f in files.values():
                f.close()
        if overflow:
            killed_for = killed_for or "results"
        records = _parse_records(results)
        rc = process.returncode
        # RLIMIT_CPU ends a busy loop with SIGXCPU.
        timed_out = timed_out or rc in (-signal.SIGXCPU, 128 + signal.SIGXCPU)
        return BoxRun(started, timed_out, rc, records, stdout,
                      output, time.monotonic() - start, killed_for)  # fmt: skip

    def _process_cap(self) -> int:
        """RLIMIT_NPROC the harness sets inside. In a user namespace bubblewrap's own init
        is one of the user's processes there; as root it is not. Unisolated there is no
        cap: the count would be all this user's processes (and root has none)."""
        if self.isolation == "unisolated":
            return 0
        return self.cfg.max_processes + (0 if self.as_root else 1)

    def _child_setup(self) -> None:
        """In the child, before exec: the limits every process of the box inherits."""
        cfg = self.cfg
        memory = cfg.memory_mb << 20
        for kind, value in {
            resource.RLIMIT_CPU: (cfg.cpu_time_s, cfg.cpu_time_s + 1),
            resource.RLIMIT_AS: (memory, memory),
            resource.RLIMIT_FSIZE: (cfg.max_output_bytes, cfg.max_output_bytes),
            resource.RLIMIT_CORE: (0, 0),
        }.items():
            resource.setrlimit(kind, value)
        if self._unboxed_filter is None:  # unisolated keeps this user's open-file limit
            resource.setrlimit(resource.RLIMIT_NOFILE, (_OPEN_FILES, _OPEN_FILES))
        else:  # the box's filter is installed by bubblewrap
            self._unboxed_filter.install()

    async def _watch(self, process, info_r: int, reader) -> tuple[str | None, bool]:
        """Wait for the box to end, killing it at the wall clock or past its memory; on
        return nothing of it runs, and when cancelled too (it is killed at once).
        (killed_for, timed_out)."""
        cfg = self.cfg
        deadline = time.monotonic() + cfg.timeout_s
        boxed = self.isolation == "bubblewrap"
        init_pid = None if boxed else process.pid
        info = bytearray()
        killed_for, timed_out = None, False
        ended = asyncio.ensure_future(process.wait())
        try:
            while not ended.done():
                if init_pid is None:
                    init_pid = _read_init_pid(info_r, info)
                if init_pid is not None and _held_bytes(init_pid) > cfg.memory_mb << 20:
                    killed_for = "memory"
                elif reader.done() and reader.result()[1]:
                    killed_for = "results"
                elif time.monotonic() > deadline:
                    timed_out = True
                if killed_for or timed_out:
                    break
                await asyncio.wait((ended,), timeout=_POLL_S)
        finally:
            _kill_group(process.pid)  # bubblewrap (its box dies with it), or the unisolated run
            await ended
            if boxed and init_pid is None:  # written before bubblewrap died, or never
                init_pid = _read_init_pid(info_r, info)
            if boxed and init_pid is not None:
                # The PID namespace dies with its init: once the init is dead, every
                # process of the box is (the kernel kills them first), so its user id is
                # free again.
                await _gone(init_pid)
        return killed_for, timed_out


async def _read_capped(pipe: BinaryIO, cap: int) -> tuple[bytes, bool]:
    """All of `pipe` until every writer closed it: (the first `cap` bytes, whether there
    was more). Reads on the event loop; closes `pipe`."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    kept, overflow = bytearray(), False
    try:
        while chunk := await reader.read(65536):
            room = cap - len(kept)
            kept += chunk[:room]
            if len(chunk) > room:
                overflow = True
                break
    finally:
        transport.close()
    return bytes(kept), overflow


def _parse_records(data: bytes) -> list[dict]:
    """The results pipe's lines as JSON objects. A line that is not a JSON object, or a
    last line cut short, leaves no records: the box is judged on nothing (failed), as a
    program that wrote on looprl's pipe deserves."""
    lines = data.split(b"\n")
    if lines[-1]:
        return []
    records = []
    for line in lines[:-1]:
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            return []
        if not isinstance(record, dict):
            return []
        records.append(record)
    return records


def _read_head(f, limit: int) -> str:
    f.seek(0)
    return f.read(limit).decode(errors="replace")


def _read_tail(f, limit: int) -> str:
    end = f.seek(0, os.SEEK_END)
    f.seek(max(0, end - limit))
    return f.read().decode(errors="replace")


def _descendants(pid: int) -> list[int]:
    """`pid` and every process below it (through /proc/PID/task/TID/children)."""
    found, todo = [], [pid]
    while todo and len(found) < 10_000:
        current = todo.pop()
        found.append(current)
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{current}/task"):
                with (
                    contextlib.suppress(OSError),
                    open(f"/proc/{current}/task/{tid}/children") as f,
                ):
                    todo += [int(p) for p in f.read().split()]
    return found


_PAGE = os.sysconf("SC_PAGE_SIZE")


def _held_bytes(pid: int) -> int:
    """Memory held by `pid` and its descendants: each one's resident set (shared pages
    counted in each), and once for each pipe and socket open in any of them, the most its
    kernel buffers hold (`_PIPE_BYTES`, `_SOCKET_BYTES`)."""
    total, buffers = 0, set()
    for p in _descendants(pid):
        with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{p}/statm") as f:
            total += int(f.read().split()[1]) * _PAGE
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{p}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{p}/fd/{fd}")
                    if target.startswith(("pipe:", "socket:")):
                        buffers.add(target)
    return total + sum(_PIPE_BYTES if b[0] == "p" else _SOCKET_BYTES for b in buffers)


def _read_init_pid(info_r: int, info: bytearray) -> int | None:
    """The box's init (the first process of its PID namespace), once bubblewrap wrote it
    on its --info-fd; `info` keeps what was read so far."""
    with contextlib.suppress(BlockingIOError):
        info += os.read(info_r, 4096)
    try:
        return json.loads(info)["child-pid"]
    except ValueError:
        return None


async def _to_the_end(work: Awaitable[T]) -> T:
    """`await work`, run as a task of its own that a cancel reaches once: the caller's
    first cancel is passed on (the box is killed and waited for in `_watch`), and the
    caller waits, through any later cancel too, until `work` is over. Only then is the
    cancel raised, and what the caller holds (a slot, a user id) let go."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait((task,))
        except asyncio.CancelledError:
            if not cancelled:
                task.cancel()
            cancelled = True
    if cancelled:
        if not task.cancelled():
            task.exception()  # seen: the caller asked for a cancel, not for this
        raise asyncio.CancelledError
    return task.result()


async def _gone(pid: int, within_s: float = 5.0) -> None:
    """Wait until process `pid` is no more (a box's init: its namespace goes with it)."""
    deadline = time.monotonic() + within_s
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return  # dead, waiting for its parent to reap it
        await asyncio.sleep(0.01)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
