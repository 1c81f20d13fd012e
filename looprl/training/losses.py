"""Policy-gradient losses: the PPO, GSPO and CISPO objectives, the engine-vs-trainer
mismatch correction, its metrics, KL to a reference, entropy.

Pure functions on tensors of shape (B, T), aligned with `input_ids`: position t holds
the logprob of token t. Only positions where `mask` is True count. Three policies meet
here: pi (the weights being trained, with grad), pi_prox (the proximal policy: the
trainer's weights before this update, `proximal_logprobs`) and pi_behav (the engine
that sampled the tokens, `behavior_logprobs`). A is the sequence's advantage.

Objectives (`train.objective`), per sampled token t of sequence i, sg = stop-gradient:

- `ppo`: PPO's clipped surrogate with clip-higher (DAPO, Yu et al., 2025):
  r_t = pi/pi_prox, loss_t = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high)).
- `gspo`: Group Sequence Policy Optimization (Zheng et al., 2025), in its GSPO-token
  form: s_i = exp(mean over i's sampled tokens of log pi - log pi_prox), the
  length-normalized sequence ratio; s_it = sg[s_i] * pi_t / sg[pi_t] has s_i's value and
  the gradient of token t's own logprob; loss_t = max(-A s_it, -A clip(s_it, 1 - eps_low,
  1 + eps_high)), so a sequence is clipped (all its tokens lose their gradient) or not as
  one. With equal advantages over a sequence's tokens, as here, its gradient is the
  sequence-level GSPO's. The paper averages per sequence then over sequences:
  `loss_agg=seq_mean_token_mean`; `token_mean` weighs each sequence by its length
  instead, `seq_mean_token_sum_norm` by its length over the batch's longest.
  Paper clip range: eps_low 3e-4, eps_high 4e-4 (v2, section 5.1).
- `cispo`: Clipped IS-weight Policy Optimization (MiniMax-M1 technical report, 2025):
  loss_t = -sg[clip(r_t, 1 - eps_low, 1 + eps_high)] * A * log pi_t. A REINFORCE term
  weighted by the truncated importance ratio: no PPO min, so every token keeps its
  gradient (PPO drops the gradient of a clipped token). The report aggregates over all
  tokens (`token_mean`) and bounds the weight from above only (eps_low large); here the
  defaults are eps_low 1 (no lower bound) and eps_high 4, a cap of 5 (ScaleRL, Khatri et
  al., 2025, found results insensitive to the cap from 4 to 8).

Mismatch correction (decoupled PPO, Hilton et al., 2022; as in AReaL and verl's rollout
importance sampling). Given `behavior_logprobs`, each token's loss is multiplied by the
behavior weight w = pi_prox/pi_behav, which corrects both staleness (tokens sampled by
older weights) and the engine's numerical difference from the trainer (bf16, kernels).
At `token` level w is per token; at `sequence` level every token of a sequence gets
the product of its tokens' weights; at `geometric` level their geometric mean
exp(mean log w_t). Then (`train.mismatch_correction`):

- `none`: w is not applied (the engine's logprobs only feed the metrics);
- `tis`: truncated importance sampling (Yao et al., 2025, "Your efficient RL framework
  secretly brings you off-policy RL training"): min(w, cap);
- `mis`: masked importance sampling: a token (or, at sequence or geometric level, a
  whole sequence) whose w is outside [floor, cap] is left out of the loss (it contributes
  0 but still counts in the normalizer), the others keep w (floor 0.5 is IcePop's).

Mismatch metrics (`mismatch_metrics`), with r = log pi_prox - log pi_behav over the
tokens given: mean |r|, the k3 estimate of KL(engine || trainer), mean of
exp(r) - 1 - r (unbiased on tokens the engine sampled, never negative), and the
fraction of tokens whose ratio pi_prox/pi_behav is outside [0.5, 2].

Aggregation, and the normalizer that makes micro-batches add up. A token-level loss is
reduced to a scalar as `sum over the micro-batch's sequences of numerator_i / normalizer`,
where `normalizer` comes from `loss_normalizer` over the WHOLE (mini-)batch the
optimizer step sees. Sequences are never split across micro-batches, so the micro-batch
losses sum to exactly the whole batch's loss:

- `token_mean`: numerator_i = sum of seq i's token losses; normalizer = sampled tokens
  in the whole batch. The global token mean (DAPO).
- `seq_mean_token_mean`: numerator_i = mean of seq i's token losses; normalizer =
  sequences with a sampled token in the whole batch. The original GRPO objective.
- `seq_mean_token_sum_norm`: numerator_i = sum of seq i's token losses; normalizer =
  sequences with a sampled token x the most sampled tokens of any sequence in the whole
  batch. Dr. GRPO's
  constant length normalization; the paper uses the generation budget and verl the
  padded response width, here it is the batch's longest sampled span.
- `turn_token_mean`: token_mean within each call position k of the rollouts (the
  turns of `TrainBatch.token_turns`), the positions weighted by their share of the
  batch's calls: a token at k has weight n_k / (N x T_k), with n_k the calls at k, T_k
  their sampled tokens and N all calls. The normalizer is then a tensor over positions
  (N x T_k / n_k at k), and `aggregate` needs each token's position. Each call weighs
  as much as any other on average however long its turn's replies run, so a 3-token
  final answer is not drowned by a 48-token first reply; with one call per rollout it
  is token_mean exactly.

A batch with no sampled token (every sample left out, see overlong.py) has normalizer 1:
its loss and gradient are 0.
"""

from __future__ import annotations

from typing import Literal

import torch

LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "turn_token_mean"]
KLEstimator = Literal["k1", "k3"]
Objective = Literal["ppo", "gspo", "cispo"]
MismatchCorrection = Literal["none", "tis", "mis"]
MismatchLevel = Literal["token", "sequence", "geometric"]

MISMATCH_RATIO_RANGE = (0.5, 2.0)  # mismatch_ratio_outside_frac counts ratios outside it


def loss_normalizer(
    loss_mask: torch.Tensor, agg: LossAgg, positions: torch.Tensor | None = None
) -> float | torch.Tensor:
    """The denominator of `aggregate` for the whole (mini-)batch, at least 1.
    loss_mask (N, T) bool. turn_token_mean: positions (N, T) int64, each sampled token's
    call position (`TrainBatch.token_turns`), and the result is a float64 tensor (K+1,):
    the denominator of the tokens at each position k (1 at 0 and where none are)."""
    if agg == "turn_token_mean":
        if positions is None:
            raise ValueError("loss_agg=turn_token_mean needs each token's call position")
        positions = positions.cpu()
        tokens = torch.bincount(positions[loss_mask.cpu()], minlength=1).double()  # T_k
        # n_k: the rows with a token at k (a row holds at most one call at k)
        at = torch.zeros(positions.shape[0], len(tokens), dtype=torch.bool)
        at[torch.arange(positions.shape[0])[:, None], positions] = True
        calls = at.sum(dim=0).double()
        calls[0] = 0
        norm = torch.where(calls > 0, calls.sum() * tokens / calls.clamp(min=1), 1.0)
        return norm
    if agg == "token_mean":
        value = loss_mask.sum()
    elif agg == "seq_mean_token_mean":
        value = loss_mask.any(dim=1).sum()
    elif agg == "seq_mean_token_sum_norm":
        value = loss_mask.any(dim=1).sum() * loss_mask.sum(dim=1).max()
    else:
        raise ValueError(f"train.loss_agg={agg!r} is not one of {list(LossAgg.__args__)}")
    return max(float(value), 1.0)


def token_weights(
    mask: torch.Tensor,
    agg: LossAgg,
    normalizer: float | torch.Tensor,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each token's weight in the aggregated loss (B, T), 0 off `mask` (B, T): `aggregate`
    is sum(values x weights). turn_token_mean: `normalizer` is loss_normalizer's tensor,
    `positions` (B, T) each token's call position."""
    if agg == "turn_token_mean":
        if positions is None:
            raise ValueError("loss_agg=turn_token_mean needs each token's call position")
        per_token = 1 / torch.as_tensor(normalizer, device=mask.device)[positions]
    elif agg == "seq_mean_token_mean":
        per_token = 1 / (mask.sum(dim=1, keepdim=True).clamp(min=1) * normalizer)
    elif agg in ("token_mean", "seq_mean_token_sum_norm"):
        per_token = torch.full(mask.shape, 1 / normalizer, device=mask.device)
    else:
        raise ValueError(f"train.loss_agg={agg!r} is not one of {list(LossAgg.__args__)}")
    return torch.where(mask, per_token, 0.0)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    agg: LossAgg,
    normalizer: float | torch.Tensor,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce per-token values (B, T) over `mask` (B, T) to this micro-batch's share:
    sum(values x `token_weights`)."""
    weights = token_weights(mask, agg, normalizer, positions).to(values.dtype)
    return (torch.where(mask, values, 0.0) * weights).sum()


def policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float,
    agg: LossAgg,
    normalizer: float | torch.Tensor,
    objective: Objective = "ppo",
    behavior_logprobs: torch.Tensor | None = None,
    mismatch_correction: MismatchCorrection = "none",
    mismatch_cap: float = float("inf"),
    mismatch_floor: float = 0.0,
    mismatch_level: MismatchLevel = "token",
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The `objective`'s loss of one micro-batch, each token's loss multiplied by its
    corrected behavior weight when `behavior_logprobs` is given (module docstring).

    logprobs, proximal_logprobs, behavior_logprobs, mask: (B, T); advantages: (B,), one
    per sequence, or (B, T), one per token (distillation).
    eps_clip, eps_clip_high: the clip range [1 - eps_clip, 1 + eps_clip_high] of the
    objective's ratio. positions: each token's call position, for turn_token_mean
    (`aggregate`). Returns the scalar loss (this micro-batch's share) and stats
    averaged over the micro-batch's sampled tokens.
    """
    if bool((torch.as_tensor(normalizer) <= 0).any()):
        raise ValueError(f"normalizer must be > 0, got {normalizer}")
    objectives = {"ppo": ppo_token_loss, "gspo": gspo_token_loss, "cispo": cispo_token_loss}
    if objective not in objectives:
        raise ValueError(f"train.objective={objective!r} is not one of {list(objectives)}")
    token_loss, clipped, ratio = objectives[objective](
        logprobs, proximal_logprobs, advantages, mask, eps_clip, eps_clip_high
    )
    keep = mask
    stats: dict[str, float] = {}
    if behavior_logprobs is not None:
        weight, keep, weight_stats = mismatch_weights(
            proximal_logprobs,
            behavior_logprobs,
            mask,
            correction=mismatch_correction,
            cap=mismatch_cap,
            floor=mismatch_floor,
            level=mismatch_level,
        )
        token_loss = token_loss * weight
        stats.update(weight_stats)
    loss = aggregate(torch.where(keep, token_loss, 0.0), mask, agg, normalizer, positions)
    with torch.no_grad():
        stats["clip_frac"] = masked_mean(clipped, mask)
        stats["ratio_mean"] = masked_mean(ratio, mask)
        stats["approx_kl"] = masked_mean(kl_penalty(logprobs, proximal_logprobs, "k3"), mask)
    return loss, stats


def ppo_token_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO: max(-A r, -A clip(r)), r = pi/pi_prox per token. (B, T) x4, (B,) -> token
    losses (B, T), clipped (B, T) bool (the clipped term won), ratio (B, T)."""
    ratio = torch.where(mask, logprobs - proximal_logprobs, 0.0).exp()  # (B, T)
    return _clipped_surrogate(ratio, advantages, eps_low, eps_high)


def gspo_token_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO-token: PPO's surrogate on s_it = sg[s_i] * pi_t / sg[pi_t], s_i the geometric
    mean of sequence i's token ratios. Shapes as `ppo_token_loss`."""
    log_ratio = torch.where(mask, logprobs - proximal_logprobs, 0.0)  # (B, T)
    seq_log_ratio = log_ratio.sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # (B,)
    own = torch.where(mask, logprobs, 0.0)  # (B, T)
    # Value s_i on every token of sequence i; gradient s_i * d log pi_t.
    ratio = (seq_log_ratio.detach()[:, None] + own - own.detach()).exp()  # (B, T)
    return _clipped_surrogate(ratio, advantages, eps_low, eps_high)


def cispo_token_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO: -sg[clip(r, 1 - eps_low, 1 + eps_high)] * A * log pi per token. Shapes as
    `ppo_token_loss`; clipped marks the tokens whose weight was truncated."""
    ratio = torch.where(mask, logprobs - proximal_logprobs, 0.0).exp().detach()  # (B, T)
    weight = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    token_loss = -per_token(advantages) * weight * logprobs
    return token_loss, weight != ratio, ratio


def per_token(advantages: torch.Tensor) -> torch.Tensor:
    """A sequence's advantage (B,) as a column (B, 1); per-token advantages (B, T), as
    distillation gives, as they are."""
    return advantages if advantages.ndim == 2 else advantages[:, None]


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    adv = per_token(advantages)  # (B, 1) or (B, T)
    unclipped_loss = -adv * ratio
    clipped_loss = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    token_loss = torch.maximum(unclipped_loss, clipped_loss)  # (B, T)
    return token_loss, clipped_loss > unclipped_loss, ratio


def mismatch_weights(
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    correction: MismatchCorrection,
    cap: float,
    floor: float = 0.0,
    level: MismatchLevel = "token",
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """The behavior weight each token's loss is multiplied by, and the tokens kept.

    proximal_logprobs, behavior_logprobs, mask: (B, T). Returns weight (B, T) (1 off the
    mask, 0 on masked tokens), keep (B, T) bool (within `mask`) and stats:
    `behavior_weight_mean` (w at `level`, after tis truncation, over sampled tokens) and
    `mismatch_corrected_frac` (sampled tokens truncated or masked).
    """
    log_w = torch.where(mask, proximal_logprobs - behavior_logprobs, 0.0)  # (B, T)
    if level == "token":
        weight = log_w.exp()
    elif level == "sequence":
        weight = torch.where(mask, log_w.sum(dim=1, keepdim=True).exp(), 1.0)
    elif level == "geometric":
        per_seq = log_w.sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # (B,)
        weight = torch.where(mask, per_seq[:, None].exp(), 1.0)
    else:
        raise ValueError(
            f"train.mismatch_level={level!r} is not one of {list(MismatchLevel.__args__)}"
        )
    keep = mask
    if correction == "none":
        corrected = torch.zeros_like(mask)
        applied = torch.ones_like(weight)
    elif correction == "tis":
        corrected = mask & (weight > cap)
        weight = applied = weight.clamp(max=cap)
    elif correction == "mis":
        corrected = mask & ((weight > cap) | (weight < floor))
        keep = mask & ~corrected
        # Zero, not just left out by `keep`: an overflowing sequence weight (inf) times a
        # zero gradient would be NaN.
        applied = torch.where(corrected, 0.0, weight)
    else:
        raise ValueError(
            f"train.mismatch_correction={correction!r} is not one of "
            f"{list(MismatchCorrection.__args__)}"
        )
    stats = {
        "behavior_weight_mean": masked_mean(weight, mask),
        "mismatch_corrected_frac": masked_mean(corrected, mask),
    }
    return applied, keep, stats


def mismatch_metrics(
    trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the engine's logprobs are from the trainer's on the same tokens, over
    `mask`: mean |trainer - engine| (`mismatch_logprob_abs_mean`), the k3 estimate of
    KL(engine || trainer) (`mismatch_kl_k3`) and the fraction of tokens whose ratio
    pi_trainer/pi_engine is outside MISMATCH_RATIO_RANGE (`mismatch_ratio_outside_frac`).
    All (B, T) (or any equal shapes); each figure 0 when `mask` is empty."""
    r = torch.where(mask, trainer_logprobs.detach() - engine_logprobs, 0.0).float()
    low, high = MISMATCH_RATIO_RANGE
    ratio = r.exp()
    return {
        "mismatch_logprob_abs_mean": masked_mean(r.abs(), mask),
        "mismatch_kl_k3": masked_mean(ratio - 1.0 - r, mask),
        "mismatch_ratio_outside_frac": masked_mean((ratio < low) | (ratio > high), mask),
    }


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
