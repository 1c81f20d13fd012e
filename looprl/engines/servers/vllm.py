"""The vLLM engine: generation and weight reloads through a vLLM server's HTTP API.

Owns: the Engine protocol over a vLLM (0.32) OpenAI-compatible server that looprl
launched (`launch_server`: its log in <run_dir>/logs/vllm-0.log) or that already runs
(`connect`). Does not own the server's process (`vllm_server.py`), the weight files
(`weight_folder.py`), the order of pause, reload and resume, nor what both servers do
alike (`server_engine.py`): it implements `ServerEngine`'s control calls.

- generate: POST /v1/completions with the prompt as token ids, `return_token_ids` and
  `logprobs` (the sampled token's, plus `top_logprobs` more, as `token_id:N` keys).
  The server runs with `--logprobs-mode processed_logprobs`, so logprobs are those of
  the distribution sampled from, after temperature, top-k and top-p (greedy: the
  untempered model's), as a Generation requires. Stop strings stay in the output ids
  (`include_stop_str_in_output`), EOS is kept as the local engine keeps it.
- update_weights: the state dict is written to <run_dir>/weights/v<version> (safetensors,
  atomically), then the server is paused, reloads it in place (POST /collective_rpc
  `reload_weights` with `weights_path`; 0.3-1.2 s for SmolLM2-135M on CPU), drops its
  prefix cache (KV of the old weights), records the version (/update_weight_version)
  and resumes.
- pause waits until every request of ours in flight has finished (`RequestGate`, then
  POST /pause?mode=wait for anyone else's), so the version cannot change under a
  running request: each generation is sampled by one version, the one it started
  with, and all its tokens carry it. Requests made while paused wait and run on the
  new weights. (The local engine instead halts mid-sequence and re-prefills with the
  new weights; vLLM's `mode=keep` would continue running requests on the new weights,
  but /v1/completions does not say which of their tokens came before the reload.)
"""

from __future__ import annotations

import logging
from pathlib import Path

from torch import nn

from looprl.config import EngineConfig
from looprl.engines.base import EngineError
from looprl.engines.servers.client import ServerClient
from looprl.engines.servers.process import ServerError
from looprl.engines.servers.server_engine import ServerEngine, launched_client, server_python
from looprl.engines.servers.vllm_server import VLLMServer, ensure_vllm_venv
from looprl.engines.servers.weight_folder import WeightFolder
from looprl.runs.paths import RunPaths
from looprl.types import Generation, SamplingParams

log = logging.getLogger(__name__)

DEFAULT_VENV = ".venv-vllm"


class VLLMEngine(ServerEngine):
    """Serves `generate` from a vLLM server under `served_name`. Build one with
    `launch_server` or `connect`."""

    kind = "vLLM"
    generate_path = "/v1/completions"
    loads_adapters = True

    def __init__(
        self, client: ServerClient, weights: WeightFolder, *, served_name: str, **kwargs
    ) -> None:
        super().__init__(client, weights, **kwargs)
        self.served_name = served_name

    @classmethod
    async def launch_server(
        cls,
        cfg: EngineConfig,
        *,
        model: nn.Module,
        tokenizer,
        run_dir: Path,
        served_name: str,
        gpus: int,
        max_lora_rank: int = 0,
    ) -> VLLMEngine:
        """Write `model`'s weights as version 0 and start a vLLM server on them (~30 s on
        CPU with --enforce-eager in engine.server_args, ~100 s compiled); with
        `max_lora_rank`, able to load LoRA adapters of up to that rank at run time."""
        python = _python(cfg, gpus)
        log_path = RunPaths(run_dir).server_logs / "vllm-0.log"

        def process_for(model_dir: Path):
            return VLLMServer(
                python,
                model_dir,
                log_path,
                served_name=served_name,
                dtype=cfg.dtype,
                max_model_len=cfg.max_model_len,
                kv_cache_gib=cfg.kv_cache_gib,
                extra_args=cfg.server_args,
                tensor_parallel_size=cfg.tensor_parallel_size,
                gpu_memory_fraction=cfg.gpu_memory_fraction,
                attention_backend=cfg.attention_backend,
                gpus=gpus,
                max_lora_rank=max_lora_rank,
            ).process

        weights = cls.weight_folder(cfg, model, tokenizer, run_dir)
        log.info("Starting a vLLM server for the engine; its log: %s", log_path)
        process = await cls.start_process(process_for, weights, model)
        client = launched_client(process)
        return cls(
            client,
            weights,
            process=process,
            process_for=process_for,
            served_name=await _served_name(client),
        )

    @classmethod
    async def connect(
        cls, cfg: EngineConfig, *, model: nn.Module, tokenizer, run_dir: Path
    ) -> VLLMEngine:
        """Use the server at engine.url: check that it can pause and reload and reports
        the logprobs a Generation needs, then load `model`'s weights into it as version 0."""
        assert cfg.url is not None, "connect needs engine.url"
        client = ServerClient(cfg.url, name="vLLM server")
        try:
            await client.get("/health")
            try:
                info = await client.get("/server_info?config_format=json")
            except EngineError as e:
                raise EngineError(
                    f"{e}. looprl pauses the server and reloads weights through vLLM's "
                    "development endpoints: start it with VLLM_SERVER_DEV_MODE=1"
                ) from e
            mode = info["vllm_config"]["model_config"]["logprobs_mode"]
            if mode != "processed_logprobs":
                raise EngineError(
                    f"the vLLM server at {cfg.url} reports logprobs_mode={mode!r}: logprobs "
                    "before temperature/top-k/top-p, not those of the distribution sampled "
                    "from; restart it with --logprobs-mode processed_logprobs"
                )
            served = await _served_name(client)
        except BaseException:
            await client.close()
            raise
        weights = cls.weight_folder(cfg, model, tokenizer, run_dir)
        return await cls.attach(client, weights, model, served_name=served)

    async def server_pause(self) -> None:
        await self.client.post("/pause", params={"mode": "wait"}, retry=True)

    async def server_resume(self) -> None:
        await self.client.post("/resume", retry=True)

    async def server_load_weights(self, path: Path, version: int) -> None:
        """Reload the weights in place, drop the prefix cache (KV of the old weights), and
        record the version."""
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
        await self.client.post("/collective_rpc", rpc, retry=True)
        await self.client.post("/reset_prefix_cache", retry=True)
        await self.client.post("/update_weight_version", {"new_version": str(version)})

    async def server_release_memory(self) -> None:
        await self.client.post("/sleep", params={"level": 1}, retry=True)

    async def server_reacquire_memory(self) -> None:
        await self.client.post("/wake_up", retry=True)

    async def server_load_adapter(self, name: str, path: Path) -> None:
        """Load the adapter folder as model `name`; the base weights stay as they are."""
        await self.client.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})

    async def server_unload_adapter(self, name: str) -> None:
        await self.client.post("/v1/unload_lora_adapter", {"lora_name": name})

    def request_body(self, prompt_ids: list[int], sampling: SamplingParams) -> dict:
        body = {
            "model": self.adapter or self.served_name,
            "prompt": list(prompt_ids),
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k or -1,
            "stop": sampling.stop,
            "stop_token_ids": sampling.stop_token_ids,
            "include_stop_str_in_output": True,
            "logprobs": sampling.top_logprobs,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        return body

    def generation(
        self, reply: dict, prompt_ids: list[int], version: int, top_logprobs: int
    ) -> Generation:
        choice = reply["choices"][0]
        output_ids = choice["token_ids"]
        finish = self.finish_reason(
            choice["finish_reason"], (choice["finish_reason"], choice.get("stop_reason"))
        )
        logprobs = choice["logprobs"]
        top = None
        if top_logprobs:
            top = [
                sorted(
                    ((int(key.removeprefix("token_id:")), value) for key, value in step.items()),
                    key=lambda pair: -pair[1],
                )[:top_logprobs]
                for step in logprobs["top_logprobs"]
            ]
        return Generation(
            prompt_ids=prompt_ids,
            output_ids=output_ids,
            logprobs=logprobs["token_logprobs"],
            versions=[version] * len(output_ids),
            finish_reason=finish,
            top_logprobs=top,
        )


def _python(cfg: EngineConfig, gpus: int) -> Path:
    """The server's python: engine.venv's; the default venv is created on CPU machines."""
    if gpus == 0 and cfg.venv is None and not (Path(DEFAULT_VENV) / "bin" / "python").exists():
        try:
            return ensure_vllm_venv(Path(DEFAULT_VENV))
        except ServerError as e:
            raise EngineError(f"{e}; or give a venv holding vLLM as engine.venv") from e
    return server_python(cfg, DEFAULT_VENV, "pip install vllm")


async def _served_name(client: ServerClient) -> str:
    """The served model's name, from /v1/models."""
    models = (await client.get("/v1/models"))["data"]
    if len(models) != 1:
        raise EngineError(
            f"the vLLM server at {client.url} serves {len(models)} models "
            f"({[m['id'] for m in models]}); the engine needs exactly one"
        )
    return models[0]["id"]
