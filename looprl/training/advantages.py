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
from dataclasses import dataclass
from typing import Literal

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
    return advantages, _stats(advantages, rewards, degenerate)


def _stats(
    advantages: torch.Tensor, rewards: torch.Tensor, degenerate: torch.Tensor
) -> dict[str, float]:
    return {
        "num_groups": float(degenerate.numel()),
        "degenerate_groups": float(degenerate.sum()),
        "reward_mean": float(rewards.mean()),
        "advantage_abs_mean": float(advantages.abs().mean()),
    }


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


# Credit over the turns of a multi-turn rollout (train.credit). A rollout's model calls
# may be several samples; each holds its turn (1-based), its episode's return and its own
# step reward r_t (types.Trajectory). Estimators above then see, per variant:
#
# - `per_call`: each sample's reward (for an env episode its return-to-go G_t), baselined
#   against every sample of its rollout group, whatever their turn.
# - `per_turn`: the same rewards, baselined only against the samples at the same turn of
#   the group's other rollouts (a turn no other rollout reached has no baseline: 0).
# - `episode`: the estimator runs on one value per rollout, its episode return, against
#   the group's other rollouts; every sample of the rollout gets its rollout's advantage.
# - `gae`: generalized advantage estimation (Schulman et al., 2016) without a learned
#   critic: V(g, k) is the mean over group g's rollouts that reached turn k of their
#   discounted return from k, R_k = r_k + gamma R_{k+1}; then per rollout, in turn order,
#   delta_k = r_k + gamma V(g, k+1) - V(g, k) (V past the rollout's last sample is 0) and
#   A_k = delta_k + gamma lambda A_{k+1}. lambda 1 gives R_k - V(g, k), per_turn's
#   dr_grpo on the discounted returns; lambda 0 the one-step TD error. grpo and
#   reinforce_pp divide A by its population std over the batch (+ eps), rloo and
#   dr_grpo keep it raw. A group whose rollouts had the same step rewards at every turn
#   gets exactly 0.

Credit = Literal["per_call", "per_turn", "episode", "gae"]


@dataclass(frozen=True)
class Episodes:
    """Where each of N samples sits: its rollout (`episode_index` (N,) int64, equal
    values one rollout), its `turn` (N,) int64, 1-based, the rollout's `episode_return`
    (N,) and its own `step_reward` (N,) (floating)."""

    episode_index: torch.Tensor
    turn: torch.Tensor
    episode_return: torch.Tensor
    step_reward: torch.Tensor

    @classmethod
    def single_turn(cls, rewards: torch.Tensor) -> Episodes:
        """Each sample a rollout of its own, at turn 1."""
        n = len(rewards)
        return cls(torch.arange(n), torch.ones(n, dtype=torch.int64), rewards, rewards)


def credit_advantages(
    credit: Credit,
    algorithm: str,
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    episodes: Episodes,
    *,
    gamma: float = 1.0,
    gae_lambda: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages (N,) of `credit` (train.credit) with the estimator `algorithm`; rewards
    (N,), group_index (N,) and `episodes` as above. Stats as compute_advantages'; groups
    are per (group, turn) under per_turn, of rollouts under episode and gae."""
    if credit == "per_call" or algorithm == "distill":  # distill: per token, no reward
        return compute_advantages(algorithm, rewards, group_index)
    if credit == "per_turn":
        key = group_index * (int(episodes.turn.max()) + 1) + episodes.turn
        return compute_advantages(algorithm, rewards, key)
    inverse, first = _first_of_each(episodes.episode_index)
    if credit == "episode":
        advantages, stats = compute_advantages(
            algorithm, episodes.episode_return[first], group_index[first]
        )
        return advantages[inverse], stats
    if credit == "gae":
        advantages = gae(
            episodes.step_reward,
            group_index,
            episodes.episode_index,
            episodes.turn,
            gamma,
            gae_lambda,
        )
        if algorithm in ("grpo", "reinforce_pp"):
            advantages = advantages / (advantages.std(correction=0) + EPS)
        _, _, _, degenerate = _groups(episodes.episode_return[first], group_index[first])
        return advantages, _stats(advantages, rewards, degenerate)
    raise ValueError(f"train.credit={credit!r} is not one of {list(Credit.__args__)}")


def _first_of_each(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For `index` (N,): each entry's dense id (N,) among its E distinct values, sorted,
    and the position (E,) of each value's first occurrence."""
    values, inverse = torch.unique(index, return_inverse=True)
    first = torch.full((len(values),), len(index), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(len(index)), "amin")
    return inverse, first


def gae(
    step_reward: torch.Tensor,
    group_index: torch.Tensor,
    episode_index: torch.Tensor,
    turn: torch.Tensor,
    gamma: float,
    lam: float,
) -> torch.Tensor:
    """Critic-free GAE (see above): the rollouts' step rewards (N,) -> advantages (N,)."""
    n = len(step_reward)
    r = step_reward.double().tolist()
    groups, episodes, turns = group_index.tolist(), episode_index.tolist(), turn.tolist()
    rollouts: dict[int, list[int]] = {}
    for i in sorted(range(n), key=lambda i: (episodes[i], turns[i])):
        rollouts.setdefault(episodes[i], []).append(i)
    returns = [0.0] * n
    for samples in rollouts.values():
        future = 0.0
        for i in reversed(samples):
            future = r[i] + gamma * future
            returns[i] = future
    totals: dict[tuple[int, int], list[float]] = {}
    for i in range(n):
        totals.setdefault((groups[i], turns[i]), []).append(returns[i])
    value = [sum(totals[groups[i], turns[i]]) / len(totals[groups[i], turns[i]]) for i in range(n)]
    # A group whose rollouts all had the same rewards turn by turn carries no signal.
    paths: dict[int, set[tuple[float, ...]]] = {}
    for samples in rollouts.values():
        paths.setdefault(groups[samples[0]], set()).add(tuple(r[i] for i in samples))
    advantages = [0.0] * n
    for samples in rollouts.values():
        if len(paths[groups[samples[0]]]) == 1:
            continue
        running, next_value = 0.0, 0.0
        for i in reversed(samples):
            delta = r[i] + gamma * next_value - value[i]
            running = delta + gamma * lam * running
            advantages[i] = running
            next_value = value[i]
    return torch.tensor(advantages, dtype=step_reward.dtype)
