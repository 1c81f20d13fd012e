"""The seccomp filter every box (and every unisolated run) starts under: the system
calls that would hold memory outside a box's budget fail with EPERM.

Owns: building the filter with libseccomp (classic BPF, through ctypes: no Python
binding is needed), handing it to bubblewrap (`--seccomp FD`), installing it on a
process without a box, and the probe that checks it is in force. Not the budgets
themselves (sandbox.py charges what stays allowed: pipes and sockets at their default
buffers).
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import subprocess
import sys
import tempfile

# Calls that would hold memory outside the budget (the box's resident memory and its
# capped tmpfs) fail with EPERM, refused by a seccomp filter that libseccomp builds.
_REFUSED_CALLS = (
    "memfd_create",  # an anonymous file, capped only by the open-file limit
    "memfd_secret",
    "shmget",  # System V shared memory, message queues and semaphore sets
    "msgget",
    "semget",
    "mq_open",  # POSIX message queues
    "io_uring_setup",  # its rings and registered buffers
    "inotify_init",  # watches, up to fs.inotify.max_user_watches of them per user
    "inotify_init1",
    "vmsplice",  # pages a pipe holds past their mapping
)
_MASK_32 = 0xFFFF_FFFF  # int arguments: their high half is ignored by the kernel
_F_SETPIPE_SZ = 1031
_SOL_SOCKET = 1
_SOCKET_BUFFER_OPTIONS = (7, 8, 32, 33)  # SO_SNDBUF, SO_RCVBUF and their FORCE twins


class _ArgCompare(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]  # fmt: skip


def refusal_filter(unix_sockets_only: bool) -> bytes:
    """The seccomp program (classic BPF, built by libseccomp) that makes `_REFUSED_CALLS`
    fail with EPERM, and growing a pipe (F_SETPIPE_SZ) or a socket's buffers past their
    default (sandbox.py charges each at it). `unix_sockets_only`: also sockets other
    than Unix ones, whose buffers (TCP's) grow by themselves; the box has no network to
    lose. Calls of another architecture (32-bit ones) kill the caller. Raises
    RuntimeError, saying why, where it cannot be built."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError as e:
        raise RuntimeError(
            f"libseccomp is not installed ({e}); install it (`apt-get install libseccomp2`)"
        ) from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(_ArgCompare)]  # fmt: skip
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    allow, refuse = 0x7FFF_0000, 0x0005_0000 | errno.EPERM  # SCMP_ACT_ALLOW, SCMP_ACT_ERRNO
    not_equal, masked_equal = 1, 7  # SCMP_CMP_NE, SCMP_CMP_MASKED_EQ

    ctx = lib.seccomp_init(allow)
    if not ctx:
        raise RuntimeError("libseccomp could not start a filter (seccomp_init failed)")
    try:

        def add(name: str, *compares: tuple[int, int, int, int]) -> None:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number == -1:  # __NR_SCMP_ERROR: this libseccomp does not know the call
                raise RuntimeError(f"libseccomp does not know the system call {name}; "
                                   "install a newer libseccomp2")  # fmt: skip
            array = (_ArgCompare * max(1, len(compares)))(*compares)
            if lib.seccomp_rule_add_array(ctx, refuse, number, len(compares), array) != 0:
                raise RuntimeError(f"libseccomp could not add the rule for {name}")

        for name in _REFUSED_CALLS:
            add(name)
        add("fcntl", (1, masked_equal, _MASK_32, _F_SETPIPE_SZ))
        for option in _SOCKET_BUFFER_OPTIONS:
            add("setsockopt", (1, masked_equal, _MASK_32, _SOL_SOCKET),
                (2, masked_equal, _MASK_32, option))  # fmt: skip
        if unix_sockets_only:
            add("socket", (0, not_equal, socket.AF_UNIX, 0))
        with tempfile.TemporaryFile() as f:
            if lib.seccomp_export_bpf(ctx, f.fileno()) != 0:
                raise RuntimeError("libseccomp could not export the filter")
            f.seek(0)
            return f.read()
    finally:
        lib.seccomp_release(ctx)


def filter_pipe(program: bytes) -> int:
    """A pipe's read end holding `program` (bubblewrap reads --seccomp's to its end)."""
    read, write = os.pipe()
    try:
        os.write(write, program)  # a few hundred bytes: the pipe holds them
    finally:
        os.close(write)
    return read


# Run under the filter before any program: fails unless the filter is in force.
REFUSAL_PROBE = (
    "import os\ntry:\n    os.memfd_create('probe')\nexcept PermissionError:\n"
    "    raise SystemExit(0)\n"
    "raise SystemExit('memfd_create was not refused: the filter is not in force')\n"
)


class _SockFprog(ctypes.Structure):  # the kernel's struct sock_fprog
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class ProcessFilter:
    """`refusal_filter`'s program, installed on a process about to run a program without
    a box (isolation=unisolated: no bubblewrap to install it). Prepared here, so that the
    child, between fork and exec, makes two prctl calls and nothing else."""

    def __init__(self, program: bytes):
        self._buffer = ctypes.create_string_buffer(program, len(program))
        self._fprog = _SockFprog(len(program) // 8, ctypes.addressof(self._buffer))
        self._prctl = ctypes.CDLL(None, use_errno=True).prctl

    def install(self) -> None:
        """In the child: no new privileges (seccomp requires it), then the filter."""
        no_new_privs, set_seccomp, mode_filter = 38, 22, 2
        program = ctypes.addressof(self._fprog)
        for call in ((no_new_privs, 1, 0, 0, 0), (set_seccomp, mode_filter, program, 0, 0)):
            if self._prctl(*map(ctypes.c_ulong, call)) != 0:
                raise OSError(ctypes.get_errno(), "prctl could not install the filter")

    def check(self) -> None:
        """Raises RuntimeError unless a process started with the filter is refused
        memfd_create."""
        done = subprocess.run(
            [os.path.realpath(sys.executable), "-I", "-S", "-c", REFUSAL_PROBE],
            capture_output=True, timeout=60, preexec_fn=self.install, env={},
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(done.stderr.decode(errors="replace").strip()[-300:])
