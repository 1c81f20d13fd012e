import logging

import pytest
import torch

from looprl.config import OverlongConfig
from looprl.training.batch import (
    build_batch,
    micro_batch_indices,
    split_mini_batches,
)
from looprl.types import Trajectory
from tests.support.batches import toy_trajectory

PAD = 0


def _trajectory(length: int, prompt: int, reward: float, group_id: str) -> Trajectory:
    """Token ids 1..length; sampled tokens at logprob -0.5, sampled by version 3."""
    return toy_trajectory(length, prompt, reward, group_id, logprob=-0.5, version=3)


def _batch():
    trajectories = [
        _trajectory(4, 2, 1.0, "a"),
        _trajectory(6, 3, 0.5, "b"),
        _trajectory(3, 1, 0.0, "a"),
        _trajectory(5, 2, 0.5, "b"),
    ]
    return build_batch(trajectories, "dr_grpo", PAD)


def test_build_batch_pads_right_and_computes_advantages():
    batch, stats = _batch()
    assert batch.input_ids.shape == (4, 6)
    assert batch.input_ids[0].tolist() == [1, 2, 3, 4, PAD, PAD]
    assert batch.attention_mask[2].tolist() == [1, 1, 1, 0, 0, 0]
    assert batch.loss_mask[0].tolist() == [False, False, True, True, False, False]
    assert batch.behavior_logprobs[0].tolist() == [0, 0, -0.5, -0.5, 0, 0]
    assert batch.versions[2].tolist() == [-1, 3, 3, -1, -1, -1]
    assert batch.group_index.tolist() == [0, 1, 0, 1]  # "a" -> 0, "b" -> 1 by first appearance
    # dr_grpo: group a = [1, 0], mean .5 -> [.5, -.5]; group b = [.5, .5] degenerate -> 0
    assert batch.advantages.tolist() == [0.5, 0.0, -0.5, 0.0]
    assert stats["degenerate_groups"] == 1
    assert stats["num_tokens"] == 4 + 6 + 3 + 5
    assert stats["num_sampled_tokens"] == 2 + 3 + 2 + 3
    assert batch.lengths.tolist() == [4, 6, 3, 5]


def test_build_batch_shapes_overlong_rewards_and_leaves_truncated_samples_out():
    # One group, dr_grpo (r - group mean), max_new_tokens 8, buffer 2 (penalty from 7 on):
    #   t0: reward 1, 4 tokens             -> 1
    #   t1: reward 1, 7 tokens             -> 1 - 0.5 = 0.5
    #   t2: reward 0, 8 tokens, truncated  -> 0 - 1 = -1, left out of the loss
    # Group mean (t2 included) 0.5 / 3: advantages [5/6, 1/3, (-7/6 ->) 0]. Without t2 in
    # the baseline they would be [0.25, -0.25].
    def sample(reward, sampled, truncated):
        traj = _trajectory(2 + sampled, 2, reward, "g")
        traj.truncated = truncated
        return traj

    trajectories = [sample(1.0, 4, False), sample(1.0, 7, False), sample(0.0, 8, True)]
    overlong = OverlongConfig(soft_penalty_buffer_tokens=2, mask_truncated=True)
    batch, stats = build_batch(trajectories, "dr_grpo", PAD, overlong, max_new_tokens=8)
    torch.testing.assert_close(batch.advantages, torch.tensor([5 / 6, 1 / 3, 0.0]))
    assert batch.rewards.tolist() == [1.0, 0.5, -1.0]
    assert batch.loss_mask.sum(dim=1).tolist() == [4, 7, 0]
    assert stats["overlong_penalized"] == 2 and stats["truncated_masked"] == 1
    assert stats["reward_mean"] == pytest.approx(2 / 3)  # the task's rewards, unshaped
    assert stats["num_sampled_tokens"] == 4 + 7 + 8  # what was sampled
    # Off (the default config): the batch of before, truncation only counted.
    plain, _ = build_batch(trajectories, "dr_grpo", PAD)
    default, stats = build_batch(trajectories, "dr_grpo", PAD, OverlongConfig(), 8)
    assert torch.equal(default.advantages, plain.advantages)
    assert torch.equal(default.loss_mask, plain.loss_mask)
    assert stats["truncated_samples"] == 1 and stats["truncated_masked"] == 0


def test_build_batch_rejects_empty():
    with pytest.raises(ValueError, match="no trajectories"):
        build_batch([], "grpo", PAD)


def test_ffd_packing():
    # Budget 16, longest first: 10 | 8 | 7 -> with 8 (2 x 8 = 16) | 5 | 3 -> with 5
    # (2 x 5 = 10; 2 x 10 and 3 x 8 are over) | 2 -> with 5, 3 (3 x 5 = 15).
    lengths = torch.tensor([10, 3, 7, 5, 2, 8])
    bins = micro_batch_indices(lengths, 16)
    assert [b.tolist() for b in bins] == [[0], [5, 2], [3, 1, 4]]


def test_ffd_gives_an_oversized_sequence_its_own_micro_batch(caplog):
    with caplog.at_level(logging.WARNING):
        bins = micro_batch_indices(torch.tensor([3, 20, 4]), 16)
    assert [b.tolist() for b in bins] == [[1], [2, 0]]
    assert "20 tokens exceeds train.max_tokens_per_mb=16" in caplog.text


def test_micro_batches_are_selected_trimmed_to_their_longest_row():
    batch, _ = _batch()
    # lengths [4, 6, 3, 5], budget 12: 6 | 5 -> with 6 (2 x 6) | 4 | 3 -> with 4 (2 x 4)
    parts = [batch.select(rows) for rows in micro_batch_indices(batch.lengths, 12)]
    assert [p.input_ids.shape for p in parts] == [(2, 6), (2, 4)]
    assert parts[1].input_ids.tolist() == [[1, 2, 3, 4], [1, 2, 3, PAD]]
    assert parts[1].advantages.tolist() == [0.5, -0.5]
    assert sum(p.num_sampled_tokens for p in parts) == batch.num_sampled_tokens


def test_split_mini_batches_by_sequence_order():
    batch, _ = _batch()
    parts = split_mini_batches(batch, 2)
    assert [p.rewards.tolist() for p in parts] == [[1.0, 0.5], [0.0, 0.5]]
    assert parts[1].input_ids.shape == (2, 5)
    with pytest.raises(ValueError, match="train.mini_batches=5"):
        split_mini_batches(batch, 5)
