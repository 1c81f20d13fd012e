"""Advantage estimators: one scalar per sequence from its reward and its group.

Pure functions on tensors. Each takes `rewards (N,)` (floating) and `group_index (N,)`
(int64; equal values form a group, any integers) and returns `(advantages (N,), stats)`.
A group whose rewards are all equal, a group of one included, carries no learning
signal: its advantages are exactly 0 and it is counted in `stats["degenerate_groups"]`.

Variants (mean_g, std_g: statistics of the sequence's own group):

- `grpo`: GRPO outcome supervision (Shao et al., 2024, DeepSeekMath §4.1.2):
  (r - mean_g) / (std_g + eps), std_g the unbiased (n - 1) sample std, as TRL and verl.
- `dr_grpo`: the advantage half of Dr. GRPO (Liu et al., 2025): r - mean_g, no std
  division. Its other half, no per-sequence length division, is the loss aggregation
  `seq_mean_token_sum_norm` in losses.py.
- `rloo`: REINFORCE Leave-One-Out (Ahmadian et al., 2024): r_i - mean of the other
  members of the group, which equals n / (n - 1) * (r_i - mean_g).
- `reinforce_pp`: REINFORCE++-baseline (Hu et al., 2025, v2; OpenRLHF
  `reinforce_baseline`): r - mean_g, divided by the population std of those centred
  values over the whole batch (degenerate groups' zeros included) + eps. Departs from
  OpenRLHF in two ways: it whitens per sequence, not per token, and folds no KL into
  the reward (`train.kl_coef` puts the KL in the loss instead).
- `distill`: on-policy distillation (Agarwal et al., 2024, GKD; Lu & Thinking Machines,
  2025): no sequence advantage (0 here); the trainer gives each sampled token the
  advantage log pi_teacher - log pi_student, the negative of the per-token reverse KL,
  minus the batch's mean of it (a baseline); the reward only shows progress.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

EPS = 1e-6

Estimator = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


def _groups(
    rewards: torch.Tensor, group_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence dense group id (N,), group sizes (G,), group means (G,), degenerate (G,)."""
    if rewards.ndim != 1 or group_index.shape != rewards.shape:
        raise ValueError(
            f"rewards must be (N,) and group_index the same shape; got "
            f"{tuple(rewards.shape)} and {tuple(group_index.shape)}"
        )
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be a floating tensor, got {rewards.dtype}")
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    num_groups = counts.numel()
    mean = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, inverse, rewards) / counts
    lowest = torch.full((num_groups,), torch.inf, dtype=rewards.dtype)
    highest = torch.full((num_groups,), -torch.inf, dtype=rewards.dtype)
    lowest.scatter_reduce_(0, inverse, rewards, "amin")
    highest.scatter_reduce_(0, inverse, rewards, "amax")
    return inverse, counts, mean, lowest == highest


def _finish(
    advantages: torch.Tensor, rewards: torch.Tensor, inverse: torch.Tensor, degenerate: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    advantages = torch.where(degenerate[inverse], 0.0, advantages)
    stats = {
        "num_groups": float(degenerate.numel()),
        "degenerate_groups": float(degenerate.sum()),
        "reward_mean": float(rewards.mean()),
        "advantage_abs_mean": float(advantages.abs().mean()),
    }
    return advantages, stats


def grpo(rewards: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """(r - mean_g) / (unbiased std_g + eps). rewards (N,), group_index (N,) -> (N,)."""
    inverse, counts, mean, degenerate = _groups(rewards, group_index)
    centred = rewards - mean[inverse]  # (N,)
    sq_sum = torch.zeros_like(mean).index_add_(0, inverse, centred**2)  # (G,)
    std = (sq_sum / (counts - 1).clamp(min=1)).sqrt()  # (G,)
    return _finish(centred / (std[inverse] + EPS), rewards, inverse, degenerate)


def dr_grpo(
    rewards: torch.Tensor, group_index: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """r - mean_g. rewards (N,), group_index (N,) -> (N,)."""
    inverse, _, mean, degenerate = _groups(rewards, group_index)
    return _finish(rewards - mean[inverse], rewards, inverse, degenerate)


def rloo(rewards: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """r_i - mean_{j != i} r_j = n/(n-1) (r_i - mean_g); singleton groups get 0. (N,) -> (N,)."""
    inverse, counts, mean, degenerate = _groups(rewards, group_index)
    scale = counts / (counts - 1).clamp(min=1)  # (G,)
    return _finish((rewards - mean[inverse]) * scale[inverse], rewards, inverse, degenerate)


def reinforce_pp(
    rewards: torch.Tensor, group_index: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """(r - mean_g) / (population std over the batch of (r - mean_g) + eps). (N,) -> (N,)."""
    inverse, _, mean, degenerate = _groups(rewards, group_index)
    centred = torch.where(degenerate[inverse], 0.0, rewards - mean[inverse])  # (N,)
    std = centred.std(correction=0)
    return _finish(centred / (std + EPS), rewards, inverse, degenerate)


def distill(
    rewards: torch.Tensor, group_index: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """Zeros (N,): distillation's advantages are per token, from the teacher (trainer.py)."""
    _groups(rewards, group_index)  # the same shape checks
    return torch.zeros_like(rewards), {}


ESTIMATORS: dict[str, Estimator] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_pp": reinforce_pp,
    "distill": distill,
}


def compute_advantages(
    name: str, rewards: torch.Tensor, group_index: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """Run the estimator `name` (train.algorithm). rewards (N,), group_index (N,) -> (N,)."""
    if name not in ESTIMATORS:
        raise ValueError(f"train.algorithm={name!r} is not one of {sorted(ESTIMATORS)}")
    return ESTIMATORS[name](rewards, group_index)
