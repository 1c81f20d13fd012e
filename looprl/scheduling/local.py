"""Everything in one process: the engine, the gateway and the rollout controller.

`launch_local` builds them for a config and tears them down in reverse order. Because
every part shares one event loop and one process, an ordinary debugger and
`breakpoint()` work anywhere, workflows included. The engine is the in-process local
one, or (engine.type=vllm/sglang) an adapter to a server process it launches.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from looprl.config import Config
from looprl.diagnostics import oom_phase
from looprl.engines.base import Engine
from looprl.engines.launch import start_engine
from looprl.gateway.app import create_app
from looprl.gateway.server import GatewayServer
from looprl.gateway.sessions import SessionStore
from looprl.models import load_model, load_tokenizer
from looprl.rollout import RolloutController
from looprl.workflow import Workflow

log = logging.getLogger(__name__)


@dataclass
class LocalParts:
    engine: Engine
    gateway: GatewayServer
    store: SessionStore
    controller: RolloutController
    tokenizer: Any


@asynccontextmanager
async def launch_local(
    cfg: Config, workflow: Workflow, *, model: nn.Module | None = None
) -> AsyncIterator[LocalParts]:
    """Start engine + gateway + controller; the engine copies `model` (e.g. the trainer's
    policy) when given, else loads the configured model."""
    tokenizer = load_tokenizer(cfg.model.path)
    engine_model = model if model is not None else load_model(cfg.model.path)
    with oom_phase("engine load", lambda: {"engine.dtype": cfg.engine.dtype}):
        engine = await start_engine(cfg, engine_model, tokenizer, cfg.run_dir)
    store = SessionStore()
    app = create_app(
        engine,
        tokenizer,
        model_name=cfg.model.name,
        store=store,
        default_sampling=cfg.sampling,
        max_model_len=cfg.engine.max_model_len or engine_model.config.max_position_embeddings,
    )
    server = GatewayServer(app, host=cfg.gateway.host, port=cfg.gateway.port)
    try:
        await server.start()
    except BaseException:
        await engine.stop()  # a launched server process must not outlive the run
        raise
    log.info("Gateway listening on %s", server.url)
    controller = RolloutController(
        server,
        workflow,
        cfg.rollout,
        model_name=cfg.model.name,
        version=lambda: engine.version,
        decode=tokenizer.decode,
        seed=cfg.run.seed,
        # The trainer recomputes logprobs at this temperature, so agents may not change it.
        sampling_overrides={"temperature": cfg.sampling.temperature},
    )
    try:
        yield LocalParts(engine, server, store, controller, tokenizer)
    finally:
        await controller.close()
        await server.stop()
        await engine.stop()
