"""The SGLang engine: generation and weight reloads through SGLang's native HTTP API.

Owns: the Engine protocol over an SGLang server that looprl launched on GPUs
(`launch_server`:
`python -m sglang.launch_server` from engine.venv, default .venv-sglang, its log in
<run_dir>/logs/sglang-0.log) or that already runs (`connect`). SGLang needs CUDA: on a
machine without GPUs only `connect` (to a server elsewhere) works. Verified here only
against a loopback server speaking the same protocol (tests/support/sglang_protocol.py), not
against SGLang itself.

The protocol followed, from sgl-project/sglang: docs/basic_usage/sampling_params.md
(the /generate request), python/sglang/srt/entrypoints/http_server.py (/generate,
/update_weights_from_disk, /pause_generation, /continue_generation, /flush_cache,
/health, /get_model_info), python/sglang/srt/managers/io_struct.py
(UpdateWeightFromDiskReqInput, PauseGenerationReqInput modes) and tokenizer_manager.py
(the reply: `output_ids`, `meta_info.finish_reason` {"type", "matched"},
`meta_info.output_token_logprobs` as [logprob, token id, text] and
`output_top_logprobs` per token):

- generate: POST /generate {input_ids, sampling_params, return_logprob, top_logprobs_num}
  with `no_stop_trim` so a stop string stays in the text as its tokens stay in the ids.
- Logprobs: SGLang's sampler (python/sglang/srt/layers/sampler.py) reports
  log_softmax(logits / temperature), before top-k, top-p and min-p (greedy: the
  untempered model's). That is the sampled distribution's only without truncation, so
  a request with top_k or top_p set is refused rather than given wrong logprobs.
- update_weights: the state dict is written to <run_dir>/weights/v<version>, then
  pause (our requests drained by `RequestGate`, then POST /pause_generation
  {"mode": "retract"}), POST /update_weights_from_disk {model_path, weight_version,
  flush_cache}, POST /continue_generation, in the order `server_engine.py` keeps for
  both servers (`SGLangEngine` implements `ServerEngine`'s control calls). Each
  generation is sampled by one version, the one it started with (see vllm.py).
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

from torch import nn

from looprl.config import EngineConfig
from looprl.engines.base import EngineError, EngineRequestError
from looprl.engines.servers.client import ServerClient
from looprl.engines.servers.process import ServerProcess, free_port
from looprl.engines.servers.server_engine import ServerEngine, launched_client, server_python
from looprl.runs.paths import RunPaths
from looprl.types import Generation, SamplingParams

log = logging.getLogger(__name__)

DEFAULT_VENV = ".venv-sglang"
# The server's key travels in its environment, as vLLM's does: on a command line,
# /proc/<pid>/cmdline shows it to every user of the machine. SGLang reads its key only
# from --api-key, so this launcher adds it to sys.argv inside the process (its spawned
# workers get sys.argv by pipe, not on their command lines) and runs
# `python -m sglang.launch_server`.
KEY_VARIABLE = "LOOPRL_SERVER_API_KEY"
LAUNCHER = (
    "import os, runpy, sys; "
    f"sys.argv += ['--api-key', os.environ.pop({KEY_VARIABLE!r})]; "
    "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)"
)


class SGLangEngine(ServerEngine):
    """Serves `generate` from an SGLang server; see the module docstring. Build one with
    `launch_server` or `connect`."""

    kind = "SGLang"
    generate_path = "/generate"

    @classmethod
    async def launch_server(
        cls, cfg: EngineConfig, *, model: nn.Module, tokenizer, run_dir: Path, served_name: str
    ) -> SGLangEngine:
        """Write `model`'s weights as version 0 and start an SGLang server on them."""
        python = server_python(cfg, DEFAULT_VENV, "pip install sglang")  # on a CUDA machine
        log_path = RunPaths(run_dir).server_logs / "sglang-0.log"

        def process_for(model_dir: Path) -> ServerProcess:
            port, key = free_port(), secrets.token_urlsafe(32)
            return ServerProcess(
                sglang_command(cfg, python, model_dir, port, served_name),
                url=f"http://127.0.0.1:{port}",
                log_path=log_path,
                env=sglang_env(key),
                name="SGLang server",
                api_key=key,
            )

        weights = cls.weight_folder(cfg, model, tokenizer, run_dir)
        log.info("Starting an SGLang server for the engine; its log: %s", log_path)
        process = await cls.start_process(process_for, weights, model)
        return cls(launched_client(process), weights, process=process, process_for=process_for)

    @classmethod
    async def connect(
        cls, cfg: EngineConfig, *, model: nn.Module, tokenizer, run_dir: Path
    ) -> SGLangEngine:
        """Use the server at engine.url and load `model`'s weights into it as version 0."""
        assert cfg.url is not None, "connect needs engine.url"
        client = ServerClient(cfg.url, name="SGLang server")
        info = await client.get("/get_model_info")
        if not info.get("is_generation", True):
            await client.close()
            raise EngineError(
                f"the SGLang server at {cfg.url} serves {info.get('model_path')!r}, which is "
                "not a generative model"
            )
        weights = cls.weight_folder(cfg, model, tokenizer, run_dir)
        return await cls.attach(client, weights, model)

    async def server_pause(self) -> None:
        await self.client.post("/pause_generation", {"mode": "retract"}, retry=True)

    async def server_resume(self) -> None:
        await self.client.post("/continue_generation", {}, retry=True)

    async def server_load_weights(self, path: Path, version: int) -> None:
        body = {"model_path": str(path), "weight_version": str(version), "flush_cache": True}
        reply = await self.client.post("/update_weights_from_disk", body, retry=True)
        if not reply.get("success", False):
            raise EngineError(
                f"the SGLang server at {self.client.url} did not load {path}: "
                f"{reply.get('message')}"
            )

    async def server_release_memory(self) -> None:
        await self.client.post("/release_memory_occupation", {}, retry=True)

    async def server_reacquire_memory(self) -> None:
        await self.client.post("/resume_memory_occupation", {}, retry=True)

    def check_sampling(self, sampling: SamplingParams) -> None:
        if not sampling.greedy and (sampling.top_k or sampling.top_p < 1):
            raise EngineRequestError(
                f"top_k={sampling.top_k}, top_p={sampling.top_p}: SGLang reports logprobs "
                "before top-k/top-p truncation, not those of the distribution it samples "
                "from; use sampling.top_k=0 and sampling.top_p=1 with engine.type=sglang, or "
                "engine.type=vllm"
            )
        if sampling.seed is not None:
            raise EngineRequestError(
                f"seed={sampling.seed}: the SGLang engine does not pass per-request seeds "
                "(SGLang honors them only with --enable-deterministic-inference); set "
                "rollout.seeded=false or use engine.type=vllm"
            )

    def request_body(self, prompt_ids: list[int], sampling: SamplingParams) -> dict:
        params = {
            "max_new_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "stop": sampling.stop,
            "stop_token_ids": sampling.stop_token_ids,
            "no_stop_trim": True,
            "skip_special_tokens": False,
        }
        return {
            "input_ids": list(prompt_ids),
            "sampling_params": params,
            "return_logprob": True,
            "top_logprobs_num": sampling.top_logprobs,
        }

    def generation(
        self, reply: dict, prompt_ids: list[int], version: int, top_logprobs: int
    ) -> Generation:
        meta = reply["meta_info"]
        finish = meta["finish_reason"]
        finish_reason = self.finish_reason(finish["type"] if finish else "", finish)
        output_ids = list(reply["output_ids"])
        # [logprob, token id, text or None] per generated token
        steps = meta["output_token_logprobs"]
        if [int(s[1]) for s in steps] != output_ids:
            raise EngineError(
                f"the SGLang server at {self.url} returned {len(output_ids)} output ids but "
                f"logprobs for {len(steps)} other tokens; looprl needs one logprob per output "
                "token"
            )
        top = None
        if top_logprobs:
            top = [
                [(int(t[1]), float(t[0])) for t in step][:top_logprobs]
                for step in meta["output_top_logprobs"]
            ]
        return Generation(
            prompt_ids=prompt_ids,
            output_ids=output_ids,
            logprobs=[float(s[0]) for s in steps],
            versions=[version] * len(output_ids),
            finish_reason=finish_reason,
            top_logprobs=top,
        )


def sglang_command(
    cfg: EngineConfig, python: Path, model_dir: Path, port: int, served_name: str
) -> list[str]:
    """`python -m sglang.launch_server` (through `LAUNCHER`) with the engine options
    passed through, on 127.0.0.1; the key is not among them (`sglang_env`)."""
    cmd = [str(python), "-c", LAUNCHER, "--model-path", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", cfg.dtype]
    cmd += ["--served-model-name", served_name, "--tp-size", str(cfg.tensor_parallel_size)]
    if cfg.gpu_memory_fraction is not None:
        cmd += ["--mem-fraction-static", str(cfg.gpu_memory_fraction)]
    if cfg.attention_backend is not None:
        cmd += ["--attention-backend", cfg.attention_backend]
    if cfg.max_model_len is not None:
        cmd += ["--context-length", str(cfg.max_model_len)]
    return cmd + list(cfg.server_args)


def sglang_env(api_key: str) -> dict[str, str]:
    """The server's environment: ours, offline for the hub, and `api_key` for LAUNCHER to
    hand SGLang as --api-key (which it requires on every path but /health and /metrics,
    its weight-loading and memory endpoints included)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", KEY_VARIABLE: api_key}
