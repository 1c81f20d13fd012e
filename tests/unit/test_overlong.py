import pytest
import torch

from looprl.config import OverlongConfig
from looprl.training.overlong import shape_overlong, soft_length_penalty


@pytest.mark.parametrize(
    ("factor", "expected"),
    [
        # L_max 10, L_buf 4: no penalty up to 6 tokens, then (6 - L) / 4, -1 at 10 and beyond
        (1.0, [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]),
        (0.5, [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]),
    ],
)
def test_soft_length_penalty_by_hand(factor, expected):
    lengths = torch.tensor([5, 6, 7, 8, 10, 11])
    penalty = soft_length_penalty(lengths, max_tokens=10, buffer_tokens=4, factor=factor)
    assert penalty.tolist() == expected


def test_no_buffer_no_penalty():
    penalty = soft_length_penalty(torch.tensor([5, 48]), max_tokens=48, buffer_tokens=0, factor=1)
    assert penalty.tolist() == [0.0, 0.0]


def test_shape_overlong_penalizes_and_leaves_truncated_samples_out():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.5])
    lengths = torch.tensor([4, 7, 8, 8])
    truncated = torch.tensor([False, False, True, False])  # the last stopped at 8 by itself
    cfg = OverlongConfig(soft_penalty_buffer_tokens=2, mask_truncated=True)
    # L_max 8 (the call's limit, as cfg.max_tokens is None), L_buf 2: 7 -> -0.5, 8 -> -1
    shaped, left_out, stats = shape_overlong(rewards, lengths, truncated, cfg, max_tokens=8)
    assert shaped.tolist() == [1.0, 0.5, -1.0, -0.5]
    assert left_out.tolist() == [False, False, True, False]
    assert stats == {"overlong_penalized": 3.0, "truncated_samples": 1.0, "truncated_masked": 1.0}
    # max_tokens in the config wins over the call's: L_max 20, nothing near it
    cfg = OverlongConfig(soft_penalty_buffer_tokens=2, max_tokens=20)
    shaped, left_out, stats = shape_overlong(rewards, lengths, truncated, cfg, max_tokens=8)
    assert torch.equal(shaped, rewards) and not left_out.any()
    assert stats["truncated_samples"] == 1 and stats["truncated_masked"] == 0
