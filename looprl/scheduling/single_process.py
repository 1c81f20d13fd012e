"""Everything in one process: the engine, the gateway, the rollout controller and the
trainer (`scheduler.type=single_process`, the default).

`start_single_process` builds them for a config and tears them down in reverse order.
Because every part shares one event loop and one process, an ordinary debugger and
`breakpoint()` work anywhere, workflows included. The engine is the in-process local
one, or (engine.type=vllm/sglang) an adapter to a server process it launches, in an
`EnginePool` of one that restarts the server when it dies (engine.max_restarts).
`LocalTrainer` is the loop's handle on a `Trainer` in this process.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from looprl.diagnostics.oom import oom_phase
from looprl.engines.base import Engine
from looprl.engines.launch import start_engine
from looprl.engines.local.engine import LocalEngine
from looprl.engines.pool import EnginePool
from looprl.engines.servers.server_engine import ServerEngine
from looprl.memory import kv_tokens_after_step, peak_allocated, reset_peak
from looprl.scheduling.parts import (
    Parts,
    build_trainer,
    gateway_and_controller,
    pause_engine_while_training,
)
from looprl.startup import Setup
from looprl.training.batch import TrainBatch
from looprl.training.policy_folder import save_policy
from looprl.training.trainer import Trainer
from looprl.workflows.protocol import Workflow

log = logging.getLogger(__name__)


class LocalTrainer:
    """A `Trainer` in this process feeding `engine`, behind the loop's `TrainerHandle`
    calls. A step runs in a worker thread, so that the event loop (gateway, workflows,
    timeouts) stays live."""

    def __init__(
        self,
        trainer: Trainer,
        engine: Engine,
        *,
        save_merged: bool = False,
        resize_kv: Callable[[int], Awaitable[None]] | None = None,
    ):
        self.trainer, self.engine = trainer, engine
        self.save_merged = save_merged
        # Collocated on a GPU: called once, with the first step's peak bytes allocated.
        self._resize_kv = resize_kv

    @property
    def version(self) -> int:
        return self.trainer.version

    async def train_step(self, batch: TrainBatch) -> dict[str, float]:
        device = self.trainer.device
        if self._resize_kv is not None:
            reset_peak(device)
        stats = await asyncio.to_thread(self.trainer.train_step, batch)
        if self._resize_kv is not None:
            resize, self._resize_kv = self._resize_kv, None
            await resize(peak_allocated(device))
        return stats

    async def step_logprobs(self) -> torch.Tensor | None:
        return self.trainer.step_logprobs

    async def push_weights(self) -> None:
        adapter = self.trainer.adapter_for_engine()
        if adapter is None:
            await self.engine.update_weights(
                self.trainer.state_dict_for_engine(), self.trainer.version
            )
        else:
            await self.engine.update_adapter(adapter, self.trainer.version)

    async def state_dict(self) -> dict[str, Any]:
        return self.trainer.state_dict()

    async def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.load_state_dict(state)

    async def save_model(self, tokenizer, out: Path) -> Path:
        return await asyncio.to_thread(
            save_policy, self.trainer.model, tokenizer, out, merged=self.save_merged
        )


@asynccontextmanager
async def start_single_process(
    setup: Setup, workflow: Workflow, *, train: bool = False, model: nn.Module | None = None
) -> AsyncIterator[Parts]:
    """Start engine + gateway + controller on `setup`'s model, and with `train` the
    trainer, whose policy the engine copies. Without `train` the engine serves `model`
    when given (its weights, e.g. a policy being trained elsewhere)."""
    cfg = setup.cfg
    if train or model is None:
        model = setup.model.load(cfg.model.dtype if train else "float32").to(setup.device)
    tokenizer = setup.model.tokenizer
    with oom_phase("engine load", lambda: {"engine.dtype": setup.precision.engine.dtype}):
        engine = await start_engine(setup, model, setup.paths)
    # After the engine copied the policy: with model.lora the trainer wraps it in place.
    trainer = build_trainer(setup, model) if train else None
    health = None
    if isinstance(engine, ServerEngine) and engine.launched:
        name, restarts = f"{engine.kind} server", cfg.engine.max_restarts
        engine = EnginePool([engine], names=[name], max_restarts=restarts)
        health = engine.stats
    pause = True
    if train:  # a server at engine.url runs elsewhere; one launched here shares our devices
        elsewhere = f"a server at engine.url {cfg.engine.url}" if cfg.engine.url else None
        pause = pause_engine_while_training(cfg, elsewhere)
    try:
        async with gateway_and_controller(
            setup, engine, tokenizer, workflow, engine_health=health, pause_engine=pause
        ) as parts:
            if trainer is not None:
                resize = None
                if setup.memory.replan and isinstance(engine, LocalEngine):
                    resize = functools.partial(resize_engine_kv, engine, setup)
                parts.trainer = LocalTrainer(
                    trainer, engine, save_merged=cfg.model.lora.save_merged, resize_kv=resize
                )
            yield parts
    finally:
        await engine.stop()  # a launched server process must not outlive the run


async def resize_engine_kv(engine: LocalEngine, setup: Setup, peak: int) -> None:
    """Give the engine, collocated with the trainer on `setup.device`, the K/V budget the
    first train step's `peak` bytes allocated leave (memory.kv_tokens_after_step, on the
    device size and K/V bytes per token of start-up's plan)."""
    plan, kv_bytes = setup.memory, engine.memory_bytes()["kv_cache"]
    tokens = kv_tokens_after_step(
        total=plan.device_bytes,
        peak=peak,
        engine_kv_bytes=kv_bytes,
        kv_bytes_per_token=plan.kv_bytes_per_token,
        cap=setup.cfg.engine.max_tokens_per_batch,
    )
    await engine.set_kv_budget(tokens)
    log.info(
        "Memory: the first train step peaked at %.1f GiB on %s (the engine's K/V then %.1f "
        "GiB); engine K/V budget %d tokens (start-up's estimate: %d)",
        peak / 2**30,
        setup.device,
        kv_bytes / 2**30,
        tokens,
        plan.engine_kv_tokens,
    )
