"""Everything in one process: the local engine, the gateway and the rollout controller.

`launch_local` builds them for a config and tears them down in reverse order. Because
every part shares one event loop and one process, an ordinary debugger and
`breakpoint()` work anywhere, workflows included.
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
from looprl.engines.local import LocalEngine
from looprl.gateway.app import create_app
from looprl.gateway.server import GatewayServer
from looprl.gateway.sessions import SessionStore
from looprl.models import eos_token_ids, load_model, load_tokenizer
from looprl.rollout import RolloutController
from looprl.workflow import Workflow

log = logging.getLogger(__name__)


@dataclass
class LocalParts:
    engine: LocalEngine
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
        engine = _engine(cfg, tokenizer, engine_model)
    store = SessionStore()
    app = create_app(
        engine,
        tokenizer,
        model_name=cfg.model.name,
        store=store,
        default_sampling=cfg.sampling,
        max_model_len=engine_model.config.max_position_embeddings,
    )
    server = GatewayServer(app, host=cfg.gateway.host, port=cfg.gateway.port)
    await server.start()
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


def _engine(cfg: Config, tokenizer: Any, engine_model: nn.Module) -> LocalEngine:
    return LocalEngine(  # keeps its own copy, in the engine's dtype
        engine_model,
        eos_token_ids=eos_token_ids(tokenizer, engine_model),
        decode=tokenizer.decode,
        dtype=cfg.engine.dtype,
        max_batch_size=cfg.engine.max_batch_size,
        max_tokens_per_batch=cfg.engine.max_tokens_per_batch,
        batch_wait_ms=cfg.engine.batch_wait_ms,
    )
