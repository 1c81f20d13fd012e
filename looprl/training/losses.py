"""Policy-gradient losses: clipped and decoupled PPO, KL to a reference, entropy.

Pure functions on tensors of shape (B, T), aligned with `input_ids`: position t holds
the logprob of token t. Only positions where `mask` is True count.

`policy_loss` is PPO's clipped surrogate with clip-higher (DAPO, Yu et al., 2025): the
ratio pi/pi_prox is clipped to [1 - eps_clip, 1 + eps_clip_high]. Given the engine's
`behavior_logprobs` it is decoupled PPO (Hilton et al., 2022; as in AReaL): the clip is
taken against the proximal policy (the trainer's weights before this update) and each
token's loss is multiplied by the behavior weight pi_prox/pi_behav. A weight above
`behavior_weight_cap` is masked (its token contributes 0 but still counts in the
normalizer) or truncated to the cap. At sequence level every token of a sequence gets
the sequence's weight exp(mean of its tokens' log weights), masked or truncated as one.

Aggregation, and the normalizer that makes micro-batches add up. A token-level loss is
reduced to a scalar as `sum over the micro-batch's sequences of numerator_i / normalizer`,
where `normalizer` comes from `loss_normalizer` over the WHOLE (mini-)batch the
optimizer step sees. Sequences are never split across micro-batches, so the micro-batch
losses sum to exactly the whole batch's loss:

- `token_mean`: numerator_i = sum of seq i's token losses; normalizer = sampled tokens
  in the whole batch. The global token mean (DAPO).
- `seq_mean_token_mean`: numerator_i = mean of seq i's token losses; normalizer =
  sequences in the whole batch. The original GRPO objective.
- `seq_mean_token_sum_norm`: numerator_i = sum of seq i's token losses; normalizer =
  sequences x the most sampled tokens of any sequence in the whole batch. Dr. GRPO's
  constant length normalization; the paper uses the generation budget and verl the
  padded response width, here it is the batch's longest sampled span.
"""

from __future__ import annotations

from typing import Literal

import torch

LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k3"]


def loss_normalizer(loss_mask: torch.Tensor, agg: LossAgg) -> float:
    """The denominator of `aggregate` for the whole (mini-)batch. loss_mask (N, T) bool."""
    if agg == "token_mean":
        return float(loss_mask.sum())
    if agg == "seq_mean_token_mean":
        return float(loss_mask.shape[0])
    if agg == "seq_mean_token_sum_norm":
        return float(loss_mask.shape[0] * loss_mask.sum(dim=1).max())
    raise ValueError(f"train.loss_agg={agg!r} is not one of {list(LossAgg.__args__)}")


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, agg: LossAgg, normalizer: float
) -> torch.Tensor:
    """Reduce per-token values (B, T) over `mask` (B, T) to this micro-batch's share."""
    masked = torch.where(mask, values, 0.0)  # (B, T)
    if agg == "seq_mean_token_mean":
        per_seq = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # (B,)
        return per_seq.sum() / normalizer
    if agg in ("token_mean", "seq_mean_token_sum_norm"):
        return masked.sum() / normalizer
    raise ValueError(f"train.loss_agg={agg!r} is not one of {list(LossAgg.__args__)}")


def policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float,
    agg: LossAgg,
    normalizer: float,
    behavior_logprobs: torch.Tensor | None = None,
    behavior_weight_cap: float | None = None,
    behavior_weight_mode: Literal["mask", "truncate"] = "mask",
    behavior_weight_level: Literal["token", "sequence"] = "token",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped (decoupled when `behavior_logprobs` is given) PPO loss of one micro-batch.

    logprobs, proximal_logprobs, behavior_logprobs, mask: (B, T); advantages: (B,).
    Returns the scalar loss (this micro-batch's share, see the module docstring) and
    stats averaged over the micro-batch's sampled tokens.
    """
    if normalizer <= 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    adv = advantages[:, None]  # (B, 1)
    log_ratio = torch.where(mask, logprobs - proximal_logprobs, 0.0)  # (B, T)
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    unclipped_loss = -adv * ratio
    clipped_loss = -adv * clipped
    token_loss = torch.maximum(unclipped_loss, clipped_loss)  # (B, T)
    keep = mask
    stats: dict[str, float] = {}
    if behavior_logprobs is not None:
        weight = behavior_weights(proximal_logprobs, behavior_logprobs, mask, behavior_weight_level)
        if behavior_weight_cap is not None:
            over = mask & (weight > behavior_weight_cap)
            stats["behavior_capped_frac"] = masked_mean(over, mask)
            if behavior_weight_mode == "mask":
                keep = mask & ~over
            elif behavior_weight_mode == "truncate":
                weight = weight.clamp(max=behavior_weight_cap)
            else:
                raise ValueError(
                    f"train.behavior_weight_mode={behavior_weight_mode!r} is not mask or truncate"
                )
        token_loss = token_loss * weight
        stats["behavior_weight_mean"] = masked_mean(weight, mask)
    loss = aggregate(torch.where(keep, token_loss, 0.0), mask, agg, normalizer)
    with torch.no_grad():
        stats["clip_frac"] = masked_mean(clipped_loss > unclipped_loss, mask)
        stats["ratio_mean"] = masked_mean(ratio, mask)
        stats["approx_kl"] = masked_mean(kl_penalty(logprobs, proximal_logprobs, "k3"), mask)
    return loss, stats


def behavior_weights(
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: Literal["token", "sequence"],
) -> torch.Tensor:
    """pi_prox/pi_behav per token (B, T), or each sequence's geometric mean on its tokens."""
    log_w = torch.where(mask, proximal_logprobs - behavior_logprobs, 0.0)  # (B, T)
    if level == "token":
        return log_w.exp()
    if level == "sequence":
        per_seq = log_w.sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # (B,)
        return torch.where(mask, per_seq[:, None].exp(), 1.0)
    raise ValueError(f"train.behavior_weight_level={level!r} is not token or sequence")


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled by pi. (B, T) -> (B, T).

    With log r = ref_logprobs - logprobs (Schulman, "Approximating KL divergence"):
    k1 = -log r (unbiased, can be negative); k3 = (r - 1) - log r (unbiased, >= 0).
    """
    log_r = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k3":
        return log_r.exp() - 1.0 - log_r
    raise ValueError(f"train.kl_estimator={estimator!r} is not one of {list(KLEstimator.__args__)}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) at each position. (B, T, V) -> (B, T)."""
    log_p = torch.log_softmax(logits.float(), dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of `values` (B, T) over `mask` (B, T), as a Python float (for stats)."""
    return float(torch.where(mask, values.float(), 0.0).sum() / mask.sum().clamp(min=1))
