"""Turning a session's recorded model calls into training samples.

Owns: assembling Trajectory tensors from Interactions, in one of two modes, and
assigning rewards. Built once here, so the loss mask is validated in one place.

- `per_call`: one sample per call: prompt tokens (mask 0) + sampled tokens (mask 1).
- `concat`: calls are chained while each call's prompt starts with the previous
  prompt + output; the tokens in between (tool results, user turns, the chat template's
  closing tokens) are masked out. When a prompt does not extend the chain (the agent
  edited history, or re-tokenizing the text gave other ids) a new sample starts there,
  and the break is counted in the stats.

Rewards: a float applies to every sample of the rollout. A dict {completion_id: reward}
gives per-call credit, so it always exports per call; calls it does not name are dropped
and counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from looprl.types import Interaction, Trajectory

TrajectoryMode = Literal["concat", "per_call"]


def build_trajectories(
    interactions: list[Interaction],
    reward: float | dict[str, float],
    mode: TrajectoryMode = "concat",
    *,
    group_id: str = "",
    session_id: str = "",
    decode: Callable[[list[int]], str] | None = None,
) -> tuple[list[Trajectory], dict[str, int]]:
    """Return the samples of one rollout and counts of what was merged or dropped."""
    stats = {
        "calls": len(interactions),
        "empty_calls": 0,
        "unrewarded_calls": 0,
        "concat_breaks": 0,
    }
    calls = [it for it in interactions if it.output_ids]
    stats["empty_calls"] = len(interactions) - len(calls)

    if isinstance(reward, dict):
        rewarded = [it for it in calls if it.completion_id in reward]
        stats["unrewarded_calls"] = len(calls) - len(rewarded)
        segments = [([it], float(reward[it.completion_id])) for it in rewarded]
    elif mode == "per_call":
        segments = [([it], float(reward)) for it in calls]
    else:
        chains = _chain(calls)
        stats["concat_breaks"] = max(len(chains) - 1, 0)
        segments = [(chain, float(reward)) for chain in chains]

    samples = [
        _assemble(chain, r, group_id=group_id, session_id=session_id, decode=decode)
        for chain, r in segments
    ]
    return samples, stats


def _chain(calls: list[Interaction]) -> list[list[Interaction]]:
    """Split calls into maximal runs where each prompt extends the previous prompt+output."""
    chains: list[list[Interaction]] = []
    tokens: list[int] = []
    for it in calls:
        if chains and it.prompt_ids[: len(tokens)] == tokens and len(it.prompt_ids) >= len(tokens):
            chains[-1].append(it)
            tokens = it.prompt_ids + it.output_ids
        else:
            chains.append([it])
            tokens = it.prompt_ids + it.output_ids
    return chains


def _assemble(
    chain: list[Interaction],
    reward: float,
    *,
    group_id: str,
    session_id: str,
    decode: Callable[[list[int]], str] | None,
) -> Trajectory:
    ids: list[int] = []
    mask: list[bool] = []
    logprobs: list[float] = []
    versions: list[int] = []
    for it in chain:
        context = it.prompt_ids[len(ids) :]  # the whole prompt for the first call
        ids += context + it.output_ids
        mask += [False] * len(context) + [True] * len(it.output_ids)
        logprobs += [0.0] * len(context) + list(it.logprobs)
        versions += [-1] * len(context) + list(it.versions)
    input_ids = torch.tensor(ids, dtype=torch.int64)
    return Trajectory(
        input_ids=input_ids,
        loss_mask=torch.tensor(mask, dtype=torch.bool),
        behavior_logprobs=torch.tensor(logprobs, dtype=torch.float32),
        versions=torch.tensor(versions, dtype=torch.int64),
        reward=reward,
        group_id=group_id,
        session_id=session_id,
        text=decode(ids) if decode else "",
    )
