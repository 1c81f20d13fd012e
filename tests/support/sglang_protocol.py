"""A small real HTTP server on loopback that speaks SGLang's native protocol.

SGLang needs CUDA and cannot run on the CPU machines the tests run on, so the SGLang
engine adapter is tested against this server instead. It serves a real Hugging Face
model (float32, on CPU) and follows SGLang's documented request and response shapes,
from sgl-project/sglang:

- docs/basic_usage/sampling_params.md: POST /generate with `input_ids`,
  `sampling_params` (max_new_tokens, stop, stop_token_ids, temperature, top_p, top_k,
  min_p, ignore_eos, skip_special_tokens, no_stop_trim, ...), `return_logprob`,
  `top_logprobs_num`, `logprob_start_len`, `rid`, `stream`.
- python/sglang/srt/managers/tokenizer_manager.py: the reply {"text", "output_ids",
  "meta_info": {"id", "finish_reason": {"type": "stop"|"length"|"abort", "matched"},
  "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
  "output_token_logprobs": [[logprob, token id, text or null]], "output_top_logprobs"}}.
- python/sglang/srt/layers/sampler.py: logprobs are log_softmax(logits / temperature)
  before top-k / top-p (greedy: of the raw logits).
- python/sglang/srt/entrypoints/http_server.py and managers/io_struct.py:
  POST /update_weights_from_disk {model_path, load_format, abort_all_requests,
  weight_version, flush_cache, ...} -> {"success", "message", "num_paused_requests"}
  (400 on failure); POST /pause_generation {"mode": "abort"|"retract"|"in_place"};
  POST /continue_generation; POST /flush_cache; GET /health; GET /get_model_info;
  POST /release_memory_occupation and /resume_memory_occupation {"tags"} (a server
  started with --enable-memory-saver; loading weights while released fails here).

What it does not model: batching, the radix cache, streaming. Requests made while
paused wait until /continue_generation, as SGLang's scheduler holds them. Every control
call is recorded in `state.calls` so tests can check what the adapter sent.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from transformers import AutoModelForCausalLM, AutoTokenizer

from looprl.engines.servers.process import free_port


class SamplingParamsIn(BaseModel):
    # SGLang's SamplingParams(**sampling_params) raises on unknown keys.
    model_config = ConfigDict(extra="forbid")
    max_new_tokens: int = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1


class GenerateReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParamsIn = SamplingParamsIn()
    rid: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False


class UpdateWeightFromDiskReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True


class MemoryOccupationReqInput(BaseModel):
    """Release/ResumeMemoryOccupationReqInput (needs --enable-memory-saver)."""

    model_config = ConfigDict(extra="forbid")
    tags: list[str] | None = None  # weights, kv_cache, ...; None: all


class PauseGenerationReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["abort", "retract", "in_place"] = "abort"


@dataclass
class ServerState:
    model: Any
    tokenizer: Any
    model_path: str
    weight_version: str = "default"
    paused: bool = False
    calls: list[tuple[str, dict]] = field(default_factory=list)
    released: bool = False  # /release_memory_occupation until /resume_memory_occupation
    running: int = 0
    aborted: bool = False
    seconds_per_token: float = 0.0  # slows generation down, to test pausing mid-request


def create_app(
    model_dir: Path, *, seconds_per_token: float = 0.0, api_key: str | None = None
) -> tuple[FastAPI, ServerState]:
    state = ServerState(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(),
        tokenizer=AutoTokenizer.from_pretrained(model_dir),
        model_path=str(model_dir),
        seconds_per_token=seconds_per_token,
    )
    resumed = asyncio.Event()
    resumed.set()
    app = FastAPI()

    if api_key is not None:  # as SGLang's --api-key: every path but /health and /metrics

        @app.middleware("http")
        async def authentication(request: Request, call_next):
            open_path = request.url.path.startswith(("/health", "/metrics"))
            if request.method == "OPTIONS" or open_path:
                return await call_next(request)
            if request.headers.get("Authorization") != f"Bearer {api_key}":
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            return await call_next(request)

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/get_model_info")
    async def get_model_info() -> dict:
        return {
            "model_path": state.model_path,
            "tokenizer_path": state.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": state.weight_version,
        }

    @app.post("/generate")
    async def generate(req: GenerateReqInput) -> Any:
        if req.input_ids is None:
            return JSONResponse({"error": {"message": "this test server needs input_ids"}}, 400)
        await resumed.wait()
        state.running += 1
        try:
            return await _generate(state, req, resumed)
        finally:
            state.running -= 1

    @app.post("/pause_generation")
    async def pause_generation(req: PauseGenerationReqInput) -> dict:
        state.calls.append(("/pause_generation", req.model_dump()))
        state.paused = True
        state.aborted = req.mode == "abort"
        resumed.clear()
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation() -> dict:
        state.calls.append(("/continue_generation", {}))
        state.paused = False
        state.aborted = False
        resumed.set()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(req: MemoryOccupationReqInput) -> dict:
        state.calls.append(("/release_memory_occupation", req.model_dump()))
        state.released = True
        return {"success": True, "message": ""}

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(req: MemoryOccupationReqInput) -> dict:
        state.calls.append(("/resume_memory_occupation", req.model_dump()))
        state.released = False
        return {"success": True, "message": ""}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Any:
        state.calls.append(("/flush_cache", {}))
        return "Cache flushed.\n"

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: UpdateWeightFromDiskReqInput) -> Any:
        state.calls.append(("/update_weights_from_disk", req.model_dump()))
        if state.released:  # the weights' memory is gone until resume_memory_occupation
            return JSONResponse(
                {"success": False, "message": "memory released; resume it first"}, 400
            )
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                req.model_path, dtype=torch.float32, output_loading_info=True
            )
            if info["missing_keys"]:
                raise ValueError(f"{req.model_path} lacks weights {sorted(info['missing_keys'])}")
        except (OSError, ValueError) as e:
            content = {"success": False, "message": f"Failed to update weights: {e}."}
            return JSONResponse({**content, "num_paused_requests": 0}, status_code=400)
        state.model = model.eval()
        state.model_path = req.model_path
        message = "Succeeded to update model weights."
        if req.weight_version is not None:
            state.weight_version = req.weight_version
            message += f" Weight version updated to {req.weight_version}."
        return {"success": True, "message": message, "num_paused_requests": 0}

    return app, state


async def _generate(state: ServerState, req: GenerateReqInput, resumed: asyncio.Event) -> dict:
    params = req.sampling_params
    stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
    eos = {state.tokenizer.eos_token_id}
    ids = list(req.input_ids)
    output, token_logprobs, top_logprobs = [], [], []
    finish: dict[str, Any] = {"type": "length", "length": params.max_new_tokens}
    for _ in range(params.max_new_tokens):
        await resumed.wait()  # paused "in place" or "retract": wait, then go on
        if state.aborted:
            finish = {"type": "abort", "message": "Abort in waiting queue"}
            break
        with torch.no_grad():
            logits = state.model(torch.tensor([ids])).logits[0, -1].float()  # (V,)
        greedy = params.temperature < 1e-6
        logprobs = (logits if greedy else logits / params.temperature).log_softmax(-1)
        if greedy:
            token = int(logits.argmax())
        else:
            token = int(torch.multinomial(_truncated(logprobs.exp(), params), 1))
        ids.append(token)
        output.append(token)
        token_logprobs.append([float(logprobs[token]), token, None])
        if req.top_logprobs_num:
            values, indices = logprobs.topk(req.top_logprobs_num)
            top_logprobs.append(
                [[float(v), int(i), None] for v, i in zip(values, indices, strict=True)]
            )
        if token in eos and not params.ignore_eos:
            finish = {"type": "stop", "matched": token}
            break
        if token in (params.stop_token_ids or []):
            finish = {"type": "stop", "matched": token}
            break
        text = state.tokenizer.decode(output)
        matched = next((s for s in stops if s in text), None)
        if matched is not None:
            finish = {"type": "stop", "matched": matched}
            break
        await asyncio.sleep(state.seconds_per_token)
    text = state.tokenizer.decode(output, skip_special_tokens=params.skip_special_tokens)
    meta: dict[str, Any] = {
        "id": req.rid or f"req-{time.monotonic_ns()}",
        "finish_reason": finish,
        "prompt_tokens": len(req.input_ids),
        "weight_version": state.weight_version,
        "completion_tokens": len(output),
        "cached_tokens": 0,
    }
    if req.return_logprob:
        meta["output_token_logprobs"] = token_logprobs
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = top_logprobs
    return {"text": text, "output_ids": output, "meta_info": meta}


def _truncated(probs: torch.Tensor, params: SamplingParamsIn) -> torch.Tensor:
    """Probabilities after top-k and top-p (SGLang samples from these; it reports the
    logprobs from before)."""
    if params.top_k > 0:
        kth = probs.topk(params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(0) - sorted_probs > params.top_p
        probs = probs.clone()
        probs[order[drop]] = 0.0
    return probs


@contextmanager
def sglang_protocol_server(
    model_dir: Path, *, seconds_per_token: float = 0.0, api_key: str | None = None
) -> Iterator[tuple[str, ServerState, uvicorn.Server]]:
    """Serve on 127.0.0.1 from a thread; yields (url, state, server)."""
    app, state = create_app(model_dir, seconds_per_token=seconds_per_token, api_key=api_key)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", state, server
    finally:
        server.should_exit = True
        thread.join(timeout=10)
