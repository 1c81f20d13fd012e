"""What counters a collapsing policy, on the trainer with a real (tiny, random-init) Llama:
the entropy bonus and its floor, and the KL to the reference. (Clip-higher's arithmetic is
tests/unit/test_losses.py's, with eps_clip_high 0.28.)

Every batch here has advantage 0 on every row, so the policy-gradient term is 0 and the
loss is exactly the term under test."""

import copy
from dataclasses import replace

import pytest
import torch

from looprl.config import TrainConfig
from looprl.models import load_model
from looprl.training.losses import entropy_from_logits, kl_penalty
from looprl.training.trainer import Trainer
from tests.support.batches import toy_batch

pytestmark = pytest.mark.kernels

SHAPES = [(9, 4, 1.0, "a"), (7, 4, 1.0, "a"), (10, 5, 0.0, "b"), (6, 5, 0.0, "b")]  # equal groups


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir)


def token_entropy(model, batch) -> torch.Tensor:
    """The entropy of each sampled token's distribution (K,), computed here by hand."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    predicting = logits[:, :-1][batch.loss_mask[:, 1:]]  # row t predicts token t + 1
    return entropy_from_logits(predicting.float())


def test_the_entropy_bonus_is_minus_its_coefficient_times_the_mean_entropy(model):
    batch = toy_batch(SHAPES, model=model)
    assert float(batch.advantages.abs().sum()) == 0
    trainer = Trainer(copy.deepcopy(model), TrainConfig(compute_dtype="float32", entropy_coef=0.1))
    before = token_entropy(trainer.model, batch)
    stats = trainer.train_step(batch)
    # token_mean: -0.1 x the mean over every sampled token (no row left out for A = 0)
    assert stats["loss"] == pytest.approx(-0.1 * float(before.mean()), rel=1e-4)
    assert stats["entropy_bonus_coef"] == 0.1
    tokens = stats["tokens_per_s"] * stats["train_time_s"]
    assert tokens == pytest.approx(batch.num_tokens)  # every row ran
    assert float(token_entropy(trainer.model, batch).mean()) > float(before.mean())


def test_the_entropy_floor_switches_the_bonus_on_only_below_it(model):
    batch = toy_batch(SHAPES, model=model)  # behavior logprobs the model's own
    nll = -float(batch.behavior_logprobs[batch.loss_mask].mean())  # ~ln(vocab): random init
    above = TrainConfig(compute_dtype="float32", entropy_coef=0.1, entropy_floor=nll - 1)
    trainer = Trainer(copy.deepcopy(model), above)
    stats = trainer.train_step(batch)
    assert stats["sampled_nll"] == pytest.approx(nll)
    assert stats["entropy_bonus_coef"] == 0.0 and stats["loss"] == 0.0
    tokens = stats["tokens_per_s"] * stats["train_time_s"]
    assert tokens == pytest.approx(int(batch.lengths.min()))  # zero-advantage rows left out
    below = TrainConfig(compute_dtype="float32", entropy_coef=0.1, entropy_floor=nll + 1)
    stats = Trainer(copy.deepcopy(model), below).train_step(batch)
    assert stats["entropy_bonus_coef"] == 0.1 and stats["loss"] < 0


def test_the_kl_term_is_its_coefficient_times_the_mean_k3_and_pulls_back(model):
    reference = copy.deepcopy(model)
    policy = copy.deepcopy(model)
    with torch.no_grad():  # the policy has drifted from the reference
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.02)
    batch = toy_batch(SHAPES, model=policy)
    ref = Trainer(copy.deepcopy(reference), TrainConfig(compute_dtype="float32"))
    ref = ref.compute_logprobs(batch)
    trainer = Trainer(
        policy, TrainConfig(compute_dtype="float32", kl_coef=0.5), ref_model=reference
    )
    own = trainer.compute_logprobs(batch)
    kl = kl_penalty(own, ref, "k3")[batch.loss_mask]
    stats = trainer.train_step(batch)
    assert stats["kl"] == pytest.approx(float(kl.mean()), rel=1e-4)
    assert stats["loss"] == pytest.approx(0.5 * float(kl.mean()), rel=1e-4)
    after = kl_penalty(trainer.compute_logprobs(batch), ref, "k3")[batch.loss_mask]
    assert float(after.mean()) < float(kl.mean())


def test_per_turn_entropy_covers_each_turns_tokens(model):
    batch = toy_batch(SHAPES, model=model)
    batch = replace(batch, turn=torch.tensor([1, 2, 1, 2]))
    trainer = Trainer(copy.deepcopy(model), TrainConfig(compute_dtype="float32", entropy_coef=0.1))
    entropy = token_entropy(trainer.model, batch)  # (K,), row-major over the sampled tokens
    rows = batch.loss_mask.nonzero()[:, 0]
    stats = trainer.train_step(batch)
    for k in (1, 2):
        expected = float(entropy[batch.turn[rows] == k].mean())
        assert stats[f"turn{k}_entropy"] == pytest.approx(expected, rel=1e-4)
