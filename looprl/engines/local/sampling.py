"""The local engine's sampler: one token per row from float32 logits, each row under its
own SamplingParams, with the logprob of the token under the distribution it was drawn
from. Pure tensors in, tensors out; the engine owns the rows and their generators.

Temperature, then top-k, then top-p define the distribution sampled from, and the
reported logprob is under exactly that distribution. Greedy rows
(SamplingParams.greedy) take the argmax and report the untempered log-softmax; top_k
beyond the vocabulary keeps every token. Draws use the inverse CDF with one uniform per
row, drawn on the host by a torch.Generator and moved to the logits' device
(torch.multinomial draws one exponential per vocabulary entry: 40% of a CPU decode
step).
"""

from __future__ import annotations

import math

import torch

from looprl.types import SamplingParams


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generator: torch.Generator,
    row_generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Pick one token per row of `logits` (B, V) float32 under `params` (B). Each row
    draws from its own generator where `row_generators` has one (a seeded request:
    independent of the batch around it), else from `generator`.

    Returns tokens (B,), logprobs (B,) and per row the top (id, logprob) pairs.
    """
    device, vocab = logits.device, logits.shape[-1]
    greedy = torch.tensor([p.greedy for p in params], device=device)
    temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device)
    top_k = torch.tensor(
        [0 if p.greedy or p.top_k >= vocab else p.top_k for p in params], device=device
    )
    top_p = torch.tensor([1.0 if p.greedy else p.top_p for p in params], device=device)

    x = logits
    if bool((temperature != 1).any()):
        x = x / temperature[:, None]
    if bool((top_k > 0).any()):
        x = _apply_top_k(x, top_k.clamp(max=x.shape[-1]))
    if bool((top_p < 1).any()):
        x = _apply_top_p(x, top_p)
    probs = x.softmax(dim=-1)  # (B, V)

    uniform = torch.rand(len(params), generator=generator)
    for i, row_generator in enumerate(row_generators):
        if row_generator is not None:
            uniform[i] = torch.rand((), generator=row_generator)
    cdf = probs.cumsum(dim=-1)  # (B, V)
    # right=True never lands on a zero-probability token; u < cdf[:, -1] always.
    u = uniform.to(device)[:, None] * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=x.shape[-1] - 1)
    if bool(greedy.any()):
        tokens = torch.where(greedy, x.argmax(dim=-1), tokens)
    # log of a float32 probability is accurate to ~1e-7 absolute, like log_softmax.
    logprobs = probs.gather(1, tokens[:, None])[:, 0].log()

    k = max(p.top_logprobs for p in params)
    top = []
    if k:
        values, ids = probs.topk(k, dim=-1)
        top = [  # tokens truncated away (probability 0) are not among the likely ones
            [(i, v) for i, v in zip(row_ids, row_values, strict=True) if v > -math.inf]
            for row_ids, row_values in zip(ids.tolist(), values.log().tolist(), strict=True)
        ]
    return tokens, logprobs, top


def _apply_top_k(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Mask all but each row's k largest logits (k 0: row untouched); ties at the kth kept."""
    kth = x.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).clamp(min=0)[:, None])
    return x.masked_fill((k[:, None] > 0) & (x < kth), -torch.inf)


def _apply_top_p(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose mass reaches p (p 1: untouched)."""
    rows = (p < 1).nonzero()[:, 0]
    sorted_x, order = x[rows].sort(dim=-1, descending=True)
    probs = sorted_x.softmax(dim=-1)
    drop = probs.cumsum(dim=-1) - probs >= p[rows, None]  # mass before it already reaches p
    drop[:, 0] = False  # the most likely token stays, whatever p (5e-324 is 0 in float32)
    x = x.clone()
    x[rows] = torch.empty_like(sorted_x).scatter(1, order, sorted_x.masked_fill(drop, -torch.inf))
    return x
