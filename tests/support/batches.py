"""Small TrainBatches for the batch, trainer, LoRA and data-parallel tests.

A shape is (length, prompt tokens, reward, group id): a sequence of `length` tokens
whose first `prompt` are the prompt and the rest sampled (in the loss).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from looprl.config import TrainConfig
from looprl.training.batch import TrainBatch, build_batch
from looprl.training.trainer import Trainer
from looprl.types import Trajectory

PAD = 2  # below the random token ids, [3, 1000)

Shape = tuple[int, int, float, str]


def toy_trajectory(
    length: int,
    prompt: int,
    reward: float,
    group_id: str,
    *,
    gen: torch.Generator | None = None,
    logprob: float = 0.0,
    version: int = 0,
) -> Trajectory:
    """Token ids random in [3, 1000) from `gen`, or 1..length without one (values a test
    can write out); sampled tokens have behavior logprob `logprob` and policy version
    `version`, prompt tokens 0 and -1."""
    loss_mask = torch.arange(length) >= prompt
    if gen is None:
        input_ids = torch.arange(1, length + 1)
    else:
        input_ids = torch.randint(3, 1000, (length,), generator=gen)
    return Trajectory(
        input_ids=input_ids,
        loss_mask=loss_mask,
        behavior_logprobs=torch.where(loss_mask, logprob, 0.0),
        versions=torch.where(loss_mask, version, -1),
        reward=reward,
        group_id=group_id,
    )


def with_own_logprobs(batch: TrainBatch, trainer: Trainer) -> TrainBatch:
    """`batch` with behavior logprobs the trainer's own on its sampled tokens, as a
    float32 engine at temperature 1 on the same weights gives."""
    logprobs = trainer.compute_logprobs(batch)
    return replace(batch, behavior_logprobs=torch.where(batch.loss_mask, logprobs, 0.0))


def toy_batch(
    shapes: list[Shape],
    *,
    seed: int = 0,
    algorithm: str = "grpo",
    model: torch.nn.Module | None = None,
    noisy: bool = False,
) -> TrainBatch:
    """One toy_trajectory per shape, token ids random from a generator seeded `seed`,
    batched by `algorithm` (its advantages), padded with PAD.

    With `model`: behavior logprobs the model's own (`with_own_logprobs` of a float32
    trainer). With `noisy` too: those logprobs plus N(0, 1) noise, so that behavior
    weights vary and some exceed any cap, and random N(0, 1) advantages (a one-row group
    would get 0 from any estimator), both drawn from the same generator after the ids.
    """
    gen = torch.Generator().manual_seed(seed)
    trajectories = [toy_trajectory(*shape, gen=gen) for shape in shapes]
    batch, _ = build_batch(trajectories, algorithm, PAD)
    if model is None:
        assert not noisy, "noisy needs a model's logprobs"
        return batch
    trainer = Trainer(model, TrainConfig(compute_dtype="float32"))
    if not noisy:
        return with_own_logprobs(batch, trainer)
    logprobs = trainer.compute_logprobs(batch)
    noise = torch.randn(batch.input_ids.shape, generator=gen)
    return replace(
        batch,
        advantages=torch.randn(batch.num_sequences, generator=gen),
        behavior_logprobs=torch.where(batch.loss_mask, logprobs + noise, 0.0),
    )
