"""What every scheduler hands the training loop: an engine behind a gateway, a rollout
controller, and a trainer handle; and the one way a trainer is built.

Owns `Parts`, the `TrainerHandle` protocol (the loop's view of the trainer, whether it
lives in this process or is a group of ranks elsewhere), `gateway_and_controller`, which
puts a gateway and a rollout controller in front of any engine, and `build_trainer`
with the rule for the distribution its logprobs are of (`trainer_sampling`). The
single-process scheduler (single_process.py) and the Ray scheduler (ray.py) differ only
in where the engine and the trainer run.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from looprl.config import Config
from looprl.engines.base import Engine
from looprl.gateway import GatewayServer, SessionStore, create_app
from looprl.rollout import RolloutController
from looprl.startup import Setup
from looprl.training.batch import TrainBatch
from looprl.training.trainer import Trainer
from looprl.types import MIN_TEMPERATURE
from looprl.workflows.protocol import Workflow

log = logging.getLogger(__name__)


def trainer_sampling(cfg: Config) -> dict[str, Any]:
    """The distribution the trainer computes logprobs under: the rollouts' own, as the
    Trainer's `temperature`, `top_k` and `top_p`.

    Decoupled PPO weighs each token by pi_trainer / pi_engine, and the engine's logprobs
    are those of the distribution it sampled from: softmax(logits / T), restricted to the
    top-k / top-p set and renormalized when sampling truncates. The trainer must take the
    same T and truncation, so they are not the agent's to change either
    (`gateway_and_controller` forces them on every session). Greedy sampling (T = 0) has
    no such distribution; the trainer then takes the model's own, T = 1, untruncated.
    """
    s = cfg.sampling
    if s.temperature < MIN_TEMPERATURE:
        return {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    return {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p}


def build_trainer(
    setup: Setup, policy: nn.Module, trainer_class: type[Trainer] = Trainer
) -> Trainer:
    """The one way a command builds its trainer: `setup`'s config on `policy` (on
    `setup.device`), in the precision start-up decided, with `trainer_sampling`, LoRA
    adapters around it with model.lora, when train.kl_coef > 0 a frozen reference copy
    of the model loaded beside it (with model.lora the frozen base is the reference), and
    with train.algorithm=distill the frozen teacher (train.teacher_path)."""
    cfg, device = setup.cfg, setup.device
    reference = teacher = None
    if cfg.train.kl_coef > 0 and not cfg.model.lora.enabled:
        reference = setup.model.load(cfg.model.dtype).to(device)
    if setup.teacher is not None:
        teacher = setup.teacher.load(cfg.model.dtype).to(device)
        if teacher.config.vocab_size != policy.config.vocab_size:
            raise ValueError(
                f"train.teacher_path={cfg.train.teacher_path!r} has a vocabulary of "
                f"{teacher.config.vocab_size} tokens, the policy {policy.config.vocab_size}: "
                "distillation compares logprobs of the same token ids, so the teacher needs "
                "the policy's tokenizer"
            )
        log.info("Distilling from %s (frozen, beside the trainer)", cfg.train.teacher_path)
    return trainer_class(
        policy,
        cfg.train,
        **trainer_sampling(cfg),
        ref_model=reference,
        lora=cfg.model.lora,
        teacher_model=teacher,
        precision=setup.precision.train,
        max_tokens_per_mb=setup.memory.train_tokens_per_mb,
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

    async def step_logprobs(self) -> torch.Tensor | None:
        """The logprobs (N, T) float32 of the last `train_step`'s batch under the weights
        it started from (the proximal ones, or under a single update the training
        forward's own), NaN where it ran no token; None before any step."""
        ...

    async def push_weights(self) -> None:
        """Give the engine(s) this trainer feeds the current weights, tagged `version`
        (with model.lora, the adapter only)."""
        ...

    async def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, schedule and version, for a recover checkpoint."""
        ...

    async def load_state_dict(self, state: dict[str, Any]) -> None: ...

    async def save_model(self, tokenizer, out: Path) -> Path:
        """The current policy as a Hugging Face folder (safetensors + tokenizer); with
        model.lora the adapter as a peft folder, and with model.lora.save_merged also the
        merged model beside it (`<out>-merged`)."""
        ...


@dataclass
class Parts:
    engine: Engine
    gateway: GatewayServer
    controller: RolloutController
    tokenizer: Any
    trainer: TrainerHandle | None = None
    pause_engine: bool = True  # while the trainer steps (pause_engine_while_training)


def pause_engine_while_training(cfg: Config, separate: str | None) -> bool:
    """engine.pause_while_training decided for this run, and logged: `separate` says why
    the engine runs apart from the trainer (auto: never paused), None that they share
    devices or CPU cores (auto: paused)."""
    setting = cfg.engine.pause_while_training
    pause = setting == "always" or (setting == "auto" and separate is None)
    if pause:
        why = "they share devices" if separate is None else "engine.pause_while_training=always"
        log.info("The engine pauses while the trainer steps (%s)", why)
    else:
        why = separate or "they share devices, but engine.pause_while_training=never"
        log.info(
            "The engine keeps generating while the trainer steps (%s); it loads new weights "
            "between its decode steps (local) or requests (a server)",
            why,
        )
    return pause


@asynccontextmanager
async def gateway_and_controller(
    setup: Setup,
    engine: Engine,
    tokenizer,
    workflow: Workflow,
    *,
    engine_health: Callable[[], dict[str, Any]] | None = None,
    pause_engine: bool = True,
) -> AsyncIterator[Parts]:
    """A gateway on `engine` and a rollout controller on the gateway; both closed on exit
    (the engine is the caller's). `engine_health` goes into the gateway's /health;
    `pause_engine`: whether the loop pauses it while the trainer steps."""
    cfg = setup.cfg
    app = create_app(
        engine,
        tokenizer,
        model_name=cfg.model.name,
        store=SessionStore(),
        default_sampling=cfg.sampling,
        max_model_len=cfg.engine.max_model_len or setup.model.context_length,
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
        # The trainer's logprobs are under this sampling (trainer_sampling says why).
        sampling_overrides={
            "temperature": cfg.sampling.temperature,
            "top_p": cfg.sampling.top_p,
            "top_k": cfg.sampling.top_k,
        },
    )
    try:
        yield Parts(engine, server, controller, tokenizer, pause_engine=pause_engine)
    finally:
        await controller.close()
        await server.stop()
