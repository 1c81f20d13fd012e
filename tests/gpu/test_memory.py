"""The memory plan on the device's real memory (looprl/memory.py): the plan start-up
makes from the free memory, an engine and a trainer built with its budgets, and the
engine's K/V budget resized from the first train step's measured peak. Under
LOOPRL_GPU_TESTS_ON=cpu the same code runs with the CPU's stand-in: no allocator
figures, so a fixed device size."""

from __future__ import annotations

import asyncio

import pytest

from looprl.config import TrainConfig
from looprl.engines.local.engine import LocalEngine
from looprl.memory import (
    ModelSizes,
    device_memory,
    kv_tokens_after_step,
    peak_allocated,
    reset_peak,
)
from looprl.precision import TrainPrecision
from looprl.training.trainer import Trainer
from tests.gpu.conftest import tiny_llama
from tests.gpu.test_trainer import SHAPES
from tests.support.batches import toy_batch
from tests.support.memory_plans import GIB, plan_for

pytestmark = pytest.mark.gpu


def test_the_plan_budgets_drive_a_collocated_engine_and_trainer(device):
    model = tiny_llama(seed=0)
    batch = toy_batch(SHAPES, model=model)
    sizes = ModelSizes.of(model.config)
    assert sizes.params == sum(p.numel() for p in model.parameters())
    found = device_memory(device)
    assert (found is None) == (device.type != "cuda")
    total, free = (found.total, found.free) if found else (8 * GIB, 8 * GIB)
    decided = plan_for(sizes, total=total, free=free, engine_cap=65536, device=str(device))
    assert decided.replan and decided.train_tokens_per_mb >= 256
    assert decided.engine_kv_tokens == 65536  # a tiny model: the cap binds on any device

    model.to(device)
    engine = LocalEngine(
        model,
        eos_token_ids=[],
        dtype="bfloat16",
        kernels="portable",
        max_tokens_per_batch=decided.engine_kv_tokens,
    )
    trainer = Trainer(
        model,
        TrainConfig(lr=1e-3),
        precision=TrainPrecision("bfloat16", True, "the gpu tests"),
        max_tokens_per_mb=decided.train_tokens_per_mb,
    )
    assert trainer.max_tokens_per_mb == decided.train_tokens_per_mb

    async def run() -> None:
        try:
            reset_peak(device)
            trainer.train_step(batch)
            peak = peak_allocated(device)
            if device.type == "cuda":
                held = sum(p.numel() * p.element_size() for p in model.parameters())
                assert peak >= held  # the trainer's weights at least were on the device
            else:
                assert peak is None
                peak = 2 * GIB
            kv = engine.memory_bytes()["kv_cache"]
            per_token = sizes.kv_bytes_per_token("bfloat16")
            tokens = kv_tokens_after_step(
                total=total, peak=peak, engine_kv_bytes=kv, kv_bytes_per_token=per_token, cap=4096
            )
            assert tokens == 4096  # a tiny model's step leaves room for the whole cap
            await engine.set_kv_budget(tokens)
            await engine.update_weights(trainer.state_dict_for_engine(), trainer.version)
            assert engine.version == 1
        finally:
            await engine.stop()

    asyncio.run(run())
    assert next(model.parameters()).device.type == device.type
