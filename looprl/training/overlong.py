"""Overlong samples: DAPO's soft length penalty and overlong filtering (Yu et al., 2025).

Owns how a sample's length changes its reward and whether a truncated sample is
trained on; `build_batch` calls `shape_overlong` before computing advantages. Does not
own how long a sample is (Trajectory.longest_call_tokens, Trajectory.truncated).

Soft overlong punishment, with L a sample's length, L_max = train.overlong.max_tokens
(None: sampling.max_new_tokens) and L_buf = soft_penalty_buffer_tokens (0: off):

    R_len(L) = 0                             if L <= L_max - L_buf
             = (L_max - L_buf - L) / L_buf   if L_max - L_buf < L <= L_max
             = -1                            if L > L_max

times soft_penalty_factor, added to the sample's reward before advantages, so a long
answer is worth a little less than the same answer made short, and a truncated one
the most less.

Overlong filtering (mask_truncated): a truncated sample is left out of the loss (its
tokens out of the loss mask and its normalizer, its advantage 0), since its reward
judges an answer it never finished. Its reward still counts in its group's baseline,
as in DAPO and TRL's mask_truncated_completions: the baseline estimates what the
policy earns on the prompt, and truncations are part of that; leaving them out would
raise the baseline of prompts the policy often fails by running long, so the samples
that did finish there would look worse than they are.
"""

from __future__ import annotations

import torch

from looprl.config import OverlongConfig


def soft_length_penalty(
    lengths: torch.Tensor, *, max_tokens: int, buffer_tokens: int, factor: float
) -> torch.Tensor:
    """R_len x factor (module docstring) of each length. lengths (N,) int -> (N,) float32,
    all <= 0; all 0 when buffer_tokens is 0.

    >>> soft_length_penalty(torch.tensor([6, 8, 9, 10, 12]), max_tokens=10, buffer_tokens=4,
    ...                     factor=1.0).tolist()
    [0.0, -0.5, -0.75, -1.0, -1.0]
    """
    if buffer_tokens == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    start = max_tokens - buffer_tokens
    return factor * ((start - lengths.float()) / buffer_tokens).clamp(min=-1.0, max=0.0)


def shape_overlong(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    truncated: torch.Tensor,
    cfg: OverlongConfig,
    max_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Rewards (N,) with the soft penalty added, and which samples (N,) bool are left out
    of the loss. lengths (N,) int, truncated (N,) bool; `max_tokens` is L_max when
    cfg.max_tokens is None. Stats: counts `overlong_penalized` (penalty < 0),
    `truncated_samples` and `truncated_masked`."""
    penalty = soft_length_penalty(
        lengths,
        max_tokens=cfg.max_tokens or max_tokens,
        buffer_tokens=cfg.soft_penalty_buffer_tokens,
        factor=cfg.soft_penalty_factor,
    )
    left_out = truncated if cfg.mask_truncated else torch.zeros_like(truncated)
    stats = {
        "overlong_penalized": float((penalty < 0).sum()),
        "truncated_samples": float(truncated.sum()),
        "truncated_masked": float(left_out.sum()),
    }
    return rewards + penalty, left_out, stats
