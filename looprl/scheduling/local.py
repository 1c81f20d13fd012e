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
from looprl.engines.local import LocalEngine
from looprl.gateway.app import create_app
from looprl.gateway.server import GatewayServer
from looprl.gateway.sessions import Session, SessionStore
from looprl.models import load_model, load_tokenizer
from looprl.rollout import RolloutController
from looprl.workflow import Workflow

log = logging.getLogger(__name__)


@dataclass
class SessionHandle:
    id: str
    base_url: str
    api_key: str


class GatewayHost:
    """Opens and closes gateway sessions for the rollout controller."""

    def __init__(self, server: GatewayServer, store: SessionStore):
        self.server = server
        self.store = store

    def open_session(self, sampling_overrides: dict[str, Any] | None = None) -> SessionHandle:
        session = self.store.open()
        session.sampling_overrides = dict(sampling_overrides or {})
        return SessionHandle(
            session.id, f"{self.server.url}/sessions/{session.id}/v1", session.api_key
        )

    def close_session(self, session_id: str) -> Session:
        return self.store.close(session_id)


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
    """Start engine + gateway + controller; `model` (e.g. the trainer's) seeds the engine."""
    tokenizer = load_tokenizer(cfg.model.path)
    engine_model = load_model(cfg.model.path, cfg.engine.dtype)
    if model is not None:
        engine_model.load_state_dict(model.state_dict())
    engine = LocalEngine(
        engine_model,
        eos_token_ids=_eos_ids(tokenizer, engine_model),
        decode=tokenizer.decode,
        dtype=cfg.engine.dtype,
        max_batch_size=cfg.engine.max_batch_size,
        max_tokens_per_batch=cfg.engine.max_tokens_per_batch,
        batch_wait_ms=cfg.engine.batch_wait_ms,
    )
    store = SessionStore()
    app = create_app(
        engine,
        tokenizer,
        model_name=cfg.model.name,
        store=store,
        default_sampling=cfg.sampling,
    )
    server = GatewayServer(app, host=cfg.gateway.host, port=cfg.gateway.port)
    await server.start()
    log.info("Gateway listening on %s", server.url)
    controller = RolloutController(
        GatewayHost(server, store),
        workflow,
        cfg.rollout,
        model_name=cfg.model.name,
        version=lambda: engine.version,
        decode=tokenizer.decode,
    )
    try:
        yield LocalParts(engine, server, store, controller, tokenizer)
    finally:
        await controller.close()
        await server.stop()
        await engine.stop()


def _eos_ids(tokenizer, model: nn.Module) -> list[int]:
    """End-of-sequence ids from the tokenizer and the model's generation config."""
    ids = {tokenizer.eos_token_id}
    configured = model.generation_config.eos_token_id
    ids.update(configured if isinstance(configured, list) else [configured])
    return sorted(i for i in ids if i is not None)
