"""What every scheduler hands the training loop: an engine behind a gateway, a rollout
controller, and a trainer handle.

Owns `Parts`, the `TrainerHandle` protocol (the loop's view of the trainer, whether it
lives in this process or is a group of ranks elsewhere) and `serve`, which puts a
gateway and a rollout controller in front of any engine. The local scheduler
(scheduling/local.py) and the Ray scheduler (scheduling/ray.py) differ only in where
the engine and the trainer run.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from looprl.config import Config
from looprl.engines.base import Engine
from looprl.gateway.app import create_app
from looprl.gateway.server import GatewayServer
from looprl.gateway.sessions import SessionStore
from looprl.rollout.controller import RolloutController
from looprl.training.batch import TrainBatch
from looprl.workflow import Workflow

log = logging.getLogger(__name__)


class TrainerHandle(Protocol):
    """The trainer as the loop drives it; every call may run elsewhere, hence async."""

    @property
    def version(self) -> int:
        """Policy version of the trainer's current weights (train steps taken)."""
        ...

    async def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One update on `batch`; returns its stats."""
        ...

    async def push_weights(self, engine: Engine) -> None:
        """Give `engine` the current weights, tagged with `version`."""
        ...

    async def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, schedule and version, for a recover checkpoint."""
        ...

    async def load_state_dict(self, state: dict[str, Any]) -> None: ...

    async def save_model(self, tokenizer, out: Path) -> Path:
        """The current policy as a Hugging Face folder (safetensors + tokenizer)."""
        ...


@dataclass
class Parts:
    engine: Engine
    gateway: GatewayServer
    store: SessionStore
    controller: RolloutController
    tokenizer: Any
    trainer: TrainerHandle | None = None


@asynccontextmanager
async def serve(
    cfg: Config, engine: Engine, tokenizer, workflow: Workflow, *, max_model_len: int
) -> AsyncIterator[Parts]:
    """A gateway on `engine` and a rollout controller on the gateway; both closed on exit
    (the engine is the caller's)."""
    store = SessionStore()
    app = create_app(
        engine,
        tokenizer,
        model_name=cfg.model.name,
        store=store,
        default_sampling=cfg.sampling,
        max_model_len=cfg.engine.max_model_len or max_model_len,
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
        yield Parts(engine, server, store, controller, tokenizer)
    finally:
        await controller.close()
        await server.stop()
