"""Trajectories -> padded training tensors, and the splits the trainer iterates over.

Owns: `TrainBatch` (right-padded (N, T) tensors plus per-sequence advantages),
`build_batch` (groups from `Trajectory.group_id`, overlong shaping from overlong.py,
advantages from advantages.py), mini-batches (by sequences, one optimizer step each)
and micro-batches (first-fit-decreasing by padded token count, one forward/backward
each). Does not own models, losses or which algorithm computes the advantages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

import torch

from looprl.config import OverlongConfig
from looprl.training.advantages import Credit, Episodes, credit_advantages
from looprl.training.losses import LossAgg, loss_normalizer, token_weights
from looprl.training.overlong import shape_overlong
from looprl.types import Trajectory

log = logging.getLogger(__name__)


@dataclass
class TrainBatch:
    """N right-padded sequences. (N, T) tensors are aligned with `input_ids` like a
    Trajectory's; padding has attention_mask 0, loss_mask False, behavior_logprobs 0,
    versions -1. `proximal_logprobs`, `ref_logprobs` and `teacher_logprobs` are filled by
    the trainer."""

    input_ids: torch.Tensor  # (N, T) int64
    attention_mask: torch.Tensor  # (N, T) int64, 1 on real tokens
    loss_mask: torch.Tensor  # (N, T) bool, True on policy-sampled tokens
    behavior_logprobs: torch.Tensor  # (N, T) float32, from the engine
    versions: torch.Tensor  # (N, T) int64
    advantages: torch.Tensor  # (N,) float32
    rewards: torch.Tensor  # (N,) float32, those advantages were computed from (shaped)
    group_index: torch.Tensor  # (N,) int64, 0..G-1 in order of first appearance
    proximal_logprobs: torch.Tensor | None = None  # (N, T) float32
    ref_logprobs: torch.Tensor | None = None  # (N, T) float32
    teacher_logprobs: torch.Tensor | None = None  # (N, T) float32, algorithm=distill
    turn: torch.Tensor | None = None  # (N,) int64, each sample's 1-based turn in its rollout

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def lengths(self) -> torch.Tensor:  # (N,) int64
        return self.attention_mask.sum(dim=1)

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def num_sampled_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def token_turns(self) -> torch.Tensor:  # (N, T) int64
        """Each sampled token's model call, as its 1-based position in the rollout, 0 on
        tokens the policy did not sample (`call_positions`)."""
        turn = self.turn if self.turn is not None else torch.ones_like(self.advantages).long()
        return call_positions(self.loss_mask, turn)

    def select(self, rows: torch.Tensor) -> TrainBatch:
        """The sub-batch of `rows` (n,) int64, trimmed to its longest row."""
        width = int(self.lengths[rows].max())
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                value = value[rows, :width] if value.ndim == 2 else value[rows]
            picked[f.name] = value
        return TrainBatch(**picked)


def build_batch(
    trajectories: list[Trajectory],
    algorithm: str,
    pad_token_id: int,
    overlong: OverlongConfig | None = None,
    max_new_tokens: int | None = None,
    *,
    credit: Credit = "per_call",
    gamma: float = 1.0,
    gae_lambda: float = 1.0,
    loss_agg: LossAgg = "token_mean",
) -> tuple[TrainBatch, dict[str, float]]:
    """Pad trajectories into a TrainBatch; trajectories with equal `group_id` form a group
    whose advantages `algorithm` (train.algorithm) computes from their rewards, shaped
    by `overlong` (train.overlong; its L_max defaults to `max_new_tokens`) first, with
    the turns of multi-turn rollouts credited as `credit` says (train.credit, with
    train.gamma and train.gae_lambda; advantages.py). A sample it leaves out keeps its
    row, with no token in the loss mask and advantage 0. Stats: the advantages'
    (`reward_mean` of the rewards before shaping), `degenerate_group_share` (the rollout
    groups whose episode returns were all equal), the overlong counts, token counts of
    what was sampled (samples left out included) and, when a rollout has several samples,
    the per-turn figures of `turn_stats` (their loss shares under `loss_agg`,
    train.loss_agg)."""
    if not trajectories:
        raise ValueError("build_batch got no trajectories")
    n, width = len(trajectories), max(t.num_tokens for t in trajectories)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros((n, width), dtype=torch.int64)
    loss_mask = torch.zeros((n, width), dtype=torch.bool)
    behavior_logprobs = torch.zeros((n, width), dtype=torch.float32)
    versions = torch.full((n, width), -1, dtype=torch.int64)
    group_ids: dict[str, int] = {}
    for i, t in enumerate(trajectories):
        length = t.num_tokens
        input_ids[i, :length] = t.input_ids
        attention_mask[i, :length] = 1
        loss_mask[i, :length] = t.loss_mask
        behavior_logprobs[i, :length] = t.behavior_logprobs
        versions[i, :length] = t.versions
        group_ids.setdefault(t.group_id, len(group_ids))
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    group_index = torch.tensor([group_ids[t.group_id] for t in trajectories], dtype=torch.int64)
    shaped, left_out, overlong_stats = rewards, torch.zeros(n, dtype=torch.bool), {}
    if overlong is not None:
        limit = overlong.max_tokens or max_new_tokens
        if limit is None:
            raise ValueError(
                "build_batch needs max_new_tokens when train.overlong.max_tokens is None"
            )
        lengths = torch.tensor([t.longest_call_tokens for t in trajectories], dtype=torch.int64)
        truncated = torch.tensor([t.truncated for t in trajectories], dtype=torch.bool)
        shaped, left_out, overlong_stats = shape_overlong(
            rewards, lengths, truncated, overlong, limit
        )
    episodes = _episodes(trajectories, shaped - rewards)
    advantages, stats = credit_advantages(
        credit, algorithm, shaped, group_index, episodes, gamma=gamma, gae_lambda=gae_lambda
    )
    stats.update(overlong_stats, reward_mean=float(rewards.mean()))
    stats["degenerate_group_share"] = degenerate_share(group_index, episodes)
    num_sampled_tokens = int(loss_mask.sum())
    loss_mask[left_out] = False
    advantages = torch.where(left_out, 0.0, advantages)
    batch = TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        behavior_logprobs=behavior_logprobs,
        versions=versions,
        advantages=advantages,
        rewards=shaped,
        group_index=group_index,
        turn=episodes.turn,
    )
    if int(batch.token_turns.max()) > 1:
        stats.update(turn_stats(batch, loss_agg))
    stats.update(
        num_sequences=float(n),
        num_tokens=float(batch.num_tokens),
        num_sampled_tokens=float(num_sampled_tokens),
        max_seq_len=float(width),
    )
    return batch, stats


def _episodes(trajectories: list[Trajectory], shaping: torch.Tensor) -> Episodes:
    """Each sample's rollout (by group and session; a sample without a session id is a
    rollout of its own), turn, episode return and step reward, with the overlong shaping
    `shaping` (N,) added to its step reward and summed into its rollout's return."""
    keys: dict[tuple[str, str | int], int] = {}
    index = [
        keys.setdefault((t.group_id, t.session_id or i), len(keys))
        for i, t in enumerate(trajectories)
    ]
    episode_index = torch.tensor(index, dtype=torch.int64)
    added = torch.zeros(len(keys)).index_add_(0, episode_index, shaping)[episode_index]
    return Episodes(
        episode_index=episode_index,
        turn=torch.tensor([t.turn for t in trajectories], dtype=torch.int64),
        episode_return=torch.tensor([t.episode_return for t in trajectories]) + added,
        step_reward=torch.tensor([t.step_reward for t in trajectories]) + shaping,
    )


def degenerate_share(group_index: torch.Tensor, episodes: Episodes) -> float:
    """The share of rollout groups whose rollouts' returns were all equal (no signal)."""
    returns: dict[int, set[float]] = {}
    seen = set()
    for g, e, r in zip(
        group_index.tolist(),
        episodes.episode_index.tolist(),
        episodes.episode_return.tolist(),
        strict=True,
    ):
        if e not in seen:
            seen.add(e)
            returns.setdefault(g, set()).add(r)
    return sum(len(values) == 1 for values in returns.values()) / len(returns)


def call_positions(loss_mask: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
    """Each sampled token's call position in its rollout (1-based), 0 elsewhere.
    loss_mask (N, T) bool, turn (N,) int64 (the position of each sample's first call)
    -> (N, T) int64. A sample's calls are its runs of sampled tokens: the tokens between
    two calls of a concatenated sample (the follow-up message, a tool result, the chat
    template's closing tokens) are not sampled, so the j-th run (0-based) is call
    turn + j.

    >>> mask = torch.tensor([[0, 1, 1, 0, 0, 1], [0, 0, 1, 1, 0, 0]], dtype=torch.bool)
    >>> call_positions(mask, torch.tensor([1, 3])).tolist()
    [[0, 1, 1, 0, 0, 2], [0, 0, 3, 3, 0, 0]]
    """
    before = torch.nn.functional.pad(loss_mask[:, :-1], (1, 0))
    runs = (loss_mask & ~before).long().cumsum(dim=1)  # run index, 1-based, per token
    return torch.where(loss_mask, turn[:, None] - 1 + runs, 0)


def turn_stats(batch: TrainBatch, loss_agg: LossAgg = "token_mean") -> dict[str, float]:
    """Per call position k (1-based) in the rollouts, over the batch's sampled tokens
    (`TrainBatch.token_turns`: a concatenated sample's calls count at their own
    positions, as separate samples' do): `turn{k}_samples` (the calls at k), the mean
    reward the estimator saw for them (`turn{k}_return_mean`), their advantages' mean
    and mean absolute value, `turn{k}_tokens` (their mean sampled tokens) and
    `turn{k}_loss_share`: the turn's share of sum |A| x token weight over the batch's
    tokens, the weights `loss_agg`'s (`losses.token_weights`): its share of the policy
    loss's gradient before clipping (0 everywhere when every advantage is 0)."""
    positions = batch.token_turns  # (N, T)
    normalizer = loss_normalizer(batch.loss_mask, loss_agg, positions)
    weights = token_weights(batch.loss_mask, loss_agg, normalizer, positions)
    weight = batch.advantages.abs()[:, None] * weights  # (N, T)
    total = float(weight.sum())
    stats = {}
    for k in range(1, int(positions.max()) + 1):
        tokens = (positions == k).sum(dim=1)  # (N,)
        at = tokens > 0
        if not bool(at.any()):
            continue
        stats[f"turn{k}_samples"] = float(at.sum())
        stats[f"turn{k}_return_mean"] = float(batch.rewards[at].mean())
        stats[f"turn{k}_advantage_mean"] = float(batch.advantages[at].mean())
        stats[f"turn{k}_advantage_abs_mean"] = float(batch.advantages[at].abs().mean())
        stats[f"turn{k}_tokens"] = float(tokens[at].float().mean())
        share = float(weight[positions == k].sum()) / total if total > 0 else 0.0
        stats[f"turn{k}_loss_share"] = share
    return stats


def micro_batch_indices(lengths: torch.Tensor, max_tokens_per_mb: int) -> list[torch.Tensor]:
    """First-fit-decreasing: row indices of each micro-batch, lengths (N,) -> [(n_i,) int64].

    Sequences are taken longest first (ties in index order) and each goes into the first
    micro-batch whose padded size, rows x longest row, stays <= max_tokens_per_mb. A
    sequence longer than the budget gets a micro-batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -int(lengths[i]))
    bins: list[list[int]] = []
    for i in order:
        length = int(lengths[i])
        for rows in bins:
            # Rows come longest first, so the bin's longest row is its first.
            if (len(rows) + 1) * int(lengths[rows[0]]) <= max_tokens_per_mb:
                rows.append(i)
                break
        else:
            if length > max_tokens_per_mb:
                log.warning(
                    "A sequence of %d tokens exceeds train.max_tokens_per_mb=%d; it gets a "
                    "micro-batch of its own. Raise max_tokens_per_mb if memory allows.",
                    length,
                    max_tokens_per_mb,
                )
            bins.append([i])
    return [torch.tensor(rows, dtype=torch.int64) for rows in bins]


def split_mini_batches(batch: TrainBatch, mini_batches: int) -> list[TrainBatch]:
    """Split `batch` by sequences, in order, into `mini_batches` near-equal parts."""
    if not 1 <= mini_batches <= batch.num_sequences:
        raise ValueError(
            f"train.mini_batches={mini_batches} must be between 1 and the "
            f"{batch.num_sequences} sequences of the batch"
        )
    rows = torch.arange(batch.num_sequences)
    return [batch.select(part) for part in rows.tensor_split(mini_batches)]
