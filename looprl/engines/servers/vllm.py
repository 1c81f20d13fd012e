"""The vLLM engine: generation and weight reloads through a vLLM server's HTTP API.

Owns: the Engine protocol over a vLLM (0.32) OpenAI-compatible server that looprl
launched (`launch`: its log in <run_dir>/logs/vllm-0.log) or that already runs
(`connect`). Does not own the server's process (`vllm_server.py`), the weight files
(`weight_folder.py`) or the order of pause, reload and resume (`reloadable_server.py`).

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

import asyncio
import logging
from pathlib import Path

from torch import nn

from looprl.config import EngineConfig
from looprl.engines.base import EngineError
from looprl.engines.servers.client import ServerClient
from looprl.engines.servers.process import ServerError
from looprl.engines.servers.reloadable import ReloadableServer, ServerCalls, ServerEngine
from looprl.engines.servers.vllm_server import VLLMServer, ensure_vllm_venv
from looprl.engines.servers.weight_folder import WeightFolder
from looprl.types import FinishReason, Generation, SamplingParams

log = logging.getLogger(__name__)

DEFAULT_VENV = ".venv-vllm"
_FINISH_REASONS: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


class VLLMEngine(ServerEngine):
    """Serves `generate` from the vLLM `server` under `served_name`. Build one with
    `launch` or `connect`."""

    def __init__(self, server: ReloadableServer, *, served_name: str, max_model_len: int):
        super().__init__(server)
        self.served_name = served_name
        self.max_model_len = max_model_len

    @classmethod
    async def launch(
        cls,
        cfg: EngineConfig,
        *,
        model: nn.Module,
        tokenizer,
        run_dir: Path,
        served_name: str,
        gpus: int,
    ) -> VLLMEngine:
        """Write `model`'s weights as version 0 and start a server on them (~30 s on CPU
        with --enforce-eager in engine.server_args, ~100 s compiled)."""
        python = _python(cfg, gpus)
        weights = WeightFolder.for_model(Path(run_dir) / "weights", model, tokenizer, cfg.dtype)
        model_dir = await asyncio.to_thread(weights.write, model.state_dict(), 0)
        process = VLLMServer(
            python,
            model_dir,
            Path(run_dir) / "logs" / "vllm-0.log",
            served_name=served_name,
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            kv_cache_gib=cfg.kv_cache_gib,
            extra_args=cfg.server_args,
            tensor_parallel_size=cfg.tensor_parallel_size,
            gpu_memory_fraction=cfg.gpu_memory_fraction,
            attention_backend=cfg.attention_backend,
            gpus=gpus,
        ).process
        log.info("Starting a vLLM server for the engine; its log: %s", process.log_path)
        server = await ReloadableServer.launch(process, weights, _CALLS)
        served, max_model_len = await _model_card(server.client)
        return cls(server, served_name=served, max_model_len=max_model_len)

    @classmethod
    async def connect(
        cls, cfg: EngineConfig, *, model: nn.Module, tokenizer, run_dir: Path
    ) -> VLLMEngine:
        """Use the server at engine.url: check that it can pause and reload and reports
        the logprobs a Generation needs, then load `model`'s weights into it as version 0
        (so it may have been started from any checkpoint of the same architecture)."""
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
            served, max_model_len = await _model_card(client)
        except BaseException:
            await client.close()
            raise
        weights = WeightFolder.for_model(Path(run_dir) / "weights", model, tokenizer, cfg.dtype)
        server = ReloadableServer(client, weights, _CALLS)
        await server.update_weights(model.state_dict(), 0)
        return cls(server, served_name=served, max_model_len=max_model_len)

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, session: str | None = None
    ) -> Generation:
        """Sample a continuation; waits while a weight reload is under way. `session` is
        not used: the server's own prefix cache finds shared prefixes."""
        if not prompt_ids:
            raise EngineError("prompt_ids is empty; the engine needs at least one prompt token")
        body = {
            "model": self.served_name,
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
        async with self.server.request() as version:
            reply = await self.server.client.post("/v1/completions", body)
        return _generation(reply, prompt_ids, version, sampling.top_logprobs, self.url)


async def _load(client: ServerClient, path: Path, version: int) -> None:
    """Reload the weights in place, drop the prefix cache (KV of the old weights), and
    record the version."""
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
    await client.post("/collective_rpc", rpc, retry=True)
    await client.post("/reset_prefix_cache", retry=True)
    await client.post("/update_weight_version", {"new_version": str(version)})


_CALLS = ServerCalls(
    pause=lambda client: client.post("/pause", params={"mode": "wait"}, retry=True),
    resume=lambda client: client.post("/resume", retry=True),
    load=_load,
    release=lambda client: client.post("/sleep", params={"level": 1}, retry=True),
    reacquire=lambda client: client.post("/wake_up", retry=True),
)


def _python(cfg: EngineConfig, gpus: int) -> Path:
    """The server's python: engine.venv's; the default venv is created on CPU machines."""
    venv = Path(cfg.venv or DEFAULT_VENV)
    python = venv / "bin" / "python"
    if python.exists():
        return python
    if gpus == 0 and cfg.venv is None:
        try:
            return ensure_vllm_venv(venv)
        except ServerError as e:
            raise EngineError(f"{e}; or give a venv holding vLLM as engine.venv") from e
    raise EngineError(
        f"engine.venv={str(venv)!r} has no bin/python; create it with vLLM installed "
        f"(`python -m venv {venv} && {venv}/bin/pip install vllm`) or point engine.venv "
        "at one"
    )


async def _model_card(client: ServerClient) -> tuple[str, int]:
    """The served model's name and context length, from /v1/models."""
    models = (await client.get("/v1/models"))["data"]
    if len(models) != 1:
        raise EngineError(
            f"the vLLM server at {client.url} serves {len(models)} models "
            f"({[m['id'] for m in models]}); the engine needs exactly one"
        )
    return models[0]["id"], int(models[0]["max_model_len"])


def _generation(
    reply: dict, prompt_ids: list[int], version: int, top_logprobs: int, url: str
) -> Generation:
    choice = reply["choices"][0]
    output_ids = choice["token_ids"]
    finish_reason = _FINISH_REASONS.get(choice["finish_reason"])
    if finish_reason is None:
        raise EngineError(
            f"the vLLM server at {url} ended a generation with finish_reason="
            f"{choice['finish_reason']!r} ({choice.get('stop_reason')!r}); looprl knows "
            f"{sorted(_FINISH_REASONS)}"
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
        prompt_ids=list(prompt_ids),
        output_ids=output_ids,
        logprobs=logprobs["token_logprobs"],
        versions=[version] * len(output_ids),
        finish_reason=finish_reason,
        top_logprobs=top,
    )
