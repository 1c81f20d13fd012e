"""One train step on the device under bf16 autocast over float32 master weights, as
start-up decides on a GPU with bf16."""

from __future__ import annotations

import math

import pytest
import torch

from looprl.config import TrainConfig
from looprl.precision import TrainPrecision
from looprl.training.trainer import Trainer
from tests.gpu.conftest import tiny_llama
from tests.support.batches import toy_batch

pytestmark = pytest.mark.gpu

# (length, prompt tokens, reward, group): two groups with mixed rewards.
SHAPES = [(9, 4, 1.0, "a"), (12, 4, 0.0, "a"), (7, 4, 0.0, "a"),
          (10, 5, 1.0, "b"), (6, 5, 1.0, "b"), (11, 5, 0.0, "b")]  # fmt: skip


def test_bf16_autocast_step_on_the_device(device):
    model = tiny_llama(seed=0)
    batch = toy_batch(SHAPES, model=model)  # behavior logprobs: float32, on the CPU
    model.to(device)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = Trainer(
        model, TrainConfig(lr=1e-3), precision=TrainPrecision("bfloat16", True, "the gpu tests")
    )
    assert trainer.device == device

    autocast = trainer.compute_logprobs(batch).cpu()
    mask = batch.loss_mask
    assert autocast.dtype == torch.float32
    torch.testing.assert_close(autocast[mask], batch.behavior_logprobs[mask], atol=0.05, rtol=0)

    stats = trainer.train_step(batch)
    assert math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])
    assert stats["grad_norm"] > 0
    for name, p in model.named_parameters():
        assert p.device == device and p.dtype == torch.float32, name
    moved = [name for name, p in model.named_parameters() if not torch.equal(p, before[name])]
    layers = [name for name in before if ".layers." in name]
    assert set(layers) <= set(moved), f"not updated: {sorted(set(layers) - set(moved))}"
    after = trainer.compute_logprobs(batch).cpu()
    assert torch.isfinite(after[mask]).all() and not torch.equal(after[mask], autocast[mask])
