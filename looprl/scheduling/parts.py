"""What every scheduler hands the training loop: an engine behind a gateway, a rollout
controller, and a trainer handle; and the one way a trainer is built.

Owns `Parts`, the `TrainerHandle` protocol (the loop's view of the trainer, whether it
lives in this process or is a group of ranks elsewhere), `gateway_and_controller`, which
puts a gateway and a rollout controller in front of any engine, and `build_trainer`
with the temperature rule. The single-process scheduler (single_process.py) and the
Ray scheduler (ray.py) differ only in where the engine and the trainer run.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from looprl.config import Config
from looprl.engines.base import Engine
from looprl.gateway import GatewayServer, SessionStore, create_app
from looprl.models import context_length, load_model
from looprl.rollout import RolloutController
from looprl.training.batch import TrainBatch
from looprl.training.trainer import Trainer
from looprl.workflow import Workflow

log = logging.getLogger(__name__)


def trainer_temperature(cfg: Config) -> float:
    """The temperature the trainer computes logprobs at: the rollouts' own.

    Decoupled PPO weighs each token by pi_trainer / pi_engine, and the engine's logprobs
    are those of the distribution it sampled from, softmax(logits / T). The trainer must
    take the same T, so the rollouts' temperature is not the agent's to change either
    (`gateway_and_controller` forces it on every session). Greedy sampling (T = 0) has
    no such distribution; the trainer then takes the model's own, T = 1.
    """
    return cfg.sampling.temperature or 1.0


def build_trainer(
    cfg: Config, policy: nn.Module, trainer_class: type[Trainer] = Trainer
) -> Trainer:
    """The trainer of `cfg` on `policy` (and its device): `trainer_temperature`, and a
    frozen reference copy of the model loaded beside it when train.kl_coef > 0."""
    reference = None
    if cfg.train.kl_coef > 0:
        device = next(policy.parameters()).device
        reference = load_model(cfg.model.path, cfg.model.dtype).to(device)
    return trainer_class(
        policy, cfg.train, temperature=trainer_temperature(cfg), ref_model=reference
    )


class TrainerHandle(Protocol):
    """The trainer as the loop drives it; every call may run elsewhere, hence async."""

    @property
    def version(self) -> int:
        """Policy version of the trainer's current weights (train steps taken)."""
        ...

    async def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One update on `batch`; returns its stats."""
        ...

    async def push_weights(self) -> None:
        """Give the engine(s) this trainer feeds the current weights, tagged `version`."""
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
    controller: RolloutController
    tokenizer: Any
    trainer: TrainerHandle | None = None


@asynccontextmanager
async def gateway_and_controller(
    cfg: Config,
    engine: Engine,
    tokenizer,
    workflow: Workflow,
    *,
    engine_health: Callable[[], dict[str, Any]] | None = None,
) -> AsyncIterator[Parts]:
    """A gateway on `engine` and a rollout controller on the gateway; both closed on exit
    (the engine is the caller's). `engine_health` goes into the gateway's /health."""
    app = create_app(
        engine,
        tokenizer,
        model_name=cfg.model.name,
        store=SessionStore(),
        default_sampling=cfg.sampling,
        max_model_len=cfg.engine.max_model_len or context_length(cfg.model.path),
        engine_health=engine_health,
        limits=cfg.gateway.limits,
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
        # The trainer's logprobs are at this temperature (trainer_temperature says why).
        sampling_overrides={"temperature": cfg.sampling.temperature},
    )
    try:
        yield Parts(engine, server, controller, tokenizer)
    finally:
        await controller.close()
        await server.stop()
