"""An inference server as a child process: launched, health-checked, logged, stopped.

Owns: running a server command (vLLM's or SGLang's, built by their modules) in its own
process group with stdout and stderr in a log file, waiting until its health URL
answers 200, turning an early exit or a timeout into ServerError with the log's last
lines, and stopping it (SIGTERM to the group, then SIGKILL). Does not own what the
server serves.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx


class ServerError(RuntimeError):
    """An inference server could not be installed, started or reached."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`cmd` run with `env`, serving at `url`; healthy once `url + health_path` is 200.
    `api_key` is the key the server was started with, for the clients that talk to it."""

    def __init__(
        self,
        cmd: list[str],
        *,
        url: str,
        log_path: Path,
        env: dict[str, str] | None = None,
        name: str = "server",
        health_path: str = "/health",
        startup_timeout_s: float = 600.0,
        api_key: str | None = None,
    ) -> None:
        self.cmd = cmd
        self.api_key = api_key  # what the server requires (Bearer), when it requires one
        self.url = url
        self.log_path = Path(log_path)
        self.name = name
        self._env = env
        self._health_url = url + health_path
        self._startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def exit_code(self, wait_s: float = 0.0) -> int | None:
        """Its exit code (-N: killed by signal N) once it has exited, waiting up to
        `wait_s` for that; None while it runs, or after `stop`."""
        if self._proc is None:
            return None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(wait_s)
        return self._proc.returncode

    def start(self) -> ServerProcess:
        """Launch and wait for the health URL; raises ServerError with the log's tail."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as log:
            log.write(f"$ {' '.join(self.cmd)}\n")
            log.flush()
            self._proc = proc = subprocess.Popen(
                self.cmd,
                env=self._env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:  # `proc`: a `stop` from another thread ends this too
                raise ServerError(
                    f"the {self.name} exited with code {proc.returncode} while "
                    f"starting; last lines of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self._health_url, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise ServerError(
            f"the {self.name} did not answer {self._health_url} within "
            f"{self._startup_timeout_s:.0f} s; last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's process group, then SIGKILL what is left of it (also
        when the leader has died: its workers may live on)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout_s)
        # What is left of the group: the leader after the timeout, or workers it left.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
