"""Turning a session's recorded model calls into training samples.

Owns: assembling Trajectory tensors from Interactions, in one of two modes, and
assigning rewards. Built once here, so the loss mask is validated in one place.

- `per_call`: one sample per call: prompt tokens (mask 0) + sampled tokens (mask 1).
- `concat`: calls are chained while each call's prompt starts with the previous
  prompt + output; the tokens in between (tool results, user turns, the chat template's
  closing tokens) are masked out. When a prompt does not extend the chain (the agent
  edited history, or re-tokenizing the text gave other ids) a new sample starts there,
  and the break is counted in the stats.

Rewards. A float R is the rollout's reward; with K calls (empty ones left out), call k
(0-based, in the order the calls finished) gets
- `broadcast`: R * discount ** (K - 1 - k): every call shares the outcome, earlier calls
  less when discount < 1 (discount = 1: all get R);
- `last_call`: R for the last call, 0 for the others.
A concatenated sample gets the reward of its last call. A dict {completion_id: reward}
gives per-call credit as it is (no discount), so it always exports per call; calls it
does not name are dropped and counted.

Place in the episode (for `train.credit`). Each sample holds `turn`, the 1-based position
of its first call among the calls, the rollout's `episode_return`, and `step_reward`,
its calls' own reward r_t: under a dict, the call's entry of `step_rewards` (its
immediate reward, where the dict holds returns) else its dict value; under a float R,
R for the sample holding the last call and 0 for the others (the outcome comes at the
end).

Length. A sample is `truncated` when any of its calls stopped at the token limit
(finish_reason "length"), and its length for overlong shaping is its longest call's
sampled tokens (`longest_call_tokens`): the limit bounds each call, not the sum.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Literal

import torch

from looprl.types import Interaction, Trajectory

TrajectoryMode = Literal["concat", "per_call"]
RewardAssignment = Literal["broadcast", "last_call"]


def build_trajectories(
    interactions: list[Interaction],
    reward: float | dict[str, float],
    mode: TrajectoryMode = "concat",
    *,
    assignment: RewardAssignment = "broadcast",
    discount: float = 1.0,
    group_id: str = "",
    session_id: str = "",
    decode: Callable[[list[int]], str] | None = None,
    episode_return: float | None = None,
    step_rewards: dict[str, float] | None = None,
) -> tuple[list[Trajectory], dict[str, int], list[str]]:
    """The samples of one rollout, counts of what was merged or dropped, and why each
    concatenation broke (one sentence per break, naming the call and the token).
    `episode_return` (None: a float reward itself, a dict's mean) and `step_rewards`: see
    the module docstring."""
    calls = [it for it in interactions if it.output_ids]
    stats = {
        "calls": len(interactions),
        "empty_calls": len(interactions) - len(calls),
        "unrewarded_calls": 0,
        "concat_breaks": 0,
        "concat_broken_sessions": 0,
    }
    reasons: list[str] = []

    if isinstance(reward, dict):
        rewarded = [it for it in calls if it.completion_id in reward]
        stats["unrewarded_calls"] = len(calls) - len(rewarded)
        segments = [([it], float(reward[it.completion_id])) for it in rewarded]
        steps = step_rewards or {}
        step_of = [float(steps.get(it.completion_id, r)) for [it], r in segments]
        if episode_return is None:
            episode_return = sum(reward.values()) / len(reward) if reward else 0.0
    else:
        per_call = call_rewards(float(reward), len(calls), assignment, discount)
        if mode == "per_call":
            chains = [[it] for it in calls]
        else:
            chains, reasons = _chain(calls, decode)
            stats["concat_breaks"] = len(reasons)
            stats["concat_broken_sessions"] = int(bool(reasons))
        ends = itertools.accumulate(len(chain) for chain in chains)  # chains split calls in order
        segments = [(chain, per_call[end - 1]) for chain, end in zip(chains, ends, strict=True)]
        step_of = [float(reward) if chain[-1] is calls[-1] else 0.0 for chain, _ in segments]
        if episode_return is None:
            episode_return = float(reward)

    position = {id(it): k for k, it in enumerate(calls, start=1)}
    samples = [
        _assemble(chain, r, group_id=group_id, session_id=session_id, decode=decode)
        for chain, r in segments
    ]
    for sample, (chain, _), step in zip(samples, segments, step_of, strict=True):
        sample.turn = position[id(chain[0])]
        sample.episode_return = float(episode_return)
        sample.step_reward = step
    return samples, stats, reasons


def call_rewards(
    reward: float, calls: int, assignment: RewardAssignment, discount: float
) -> list[float]:
    """Each call's share of a rollout reward, in call order (see the module docstring).

    >>> call_rewards(1.0, 3, "broadcast", 0.5)
    [0.25, 0.5, 1.0]
    >>> call_rewards(1.0, 3, "last_call", 0.5)
    [0.0, 0.0, 1.0]
    """
    if assignment == "last_call":
        return [0.0] * (calls - 1) + [reward] if calls else []
    return [reward * discount ** (calls - 1 - k) for k in range(calls)]


def call_records(
    interactions: list[Interaction],
    reward: float | dict[str, float],
    *,
    assignment: RewardAssignment = "broadcast",
    discount: float = 1.0,
) -> list[dict]:
    """Each call of a rollout as JSON-ready data, in call order, for the trajectory files:
    its messages, reply, tool calls, finish reason, times, token limit (the one it ran
    under and the one its request asked for), and its reward as
    `build_trajectories` assigns it (None for an empty call or one a reward dict skips)."""
    if isinstance(reward, dict):
        rewards = [reward.get(it.completion_id) if it.output_ids else None for it in interactions]
    else:
        sampled = sum(bool(it.output_ids) for it in interactions)
        shares = iter(call_rewards(float(reward), sampled, assignment, discount))
        rewards = [next(shares) if it.output_ids else None for it in interactions]
    return [
        {
            "completion_id": it.completion_id,
            "messages": it.messages or [],
            "reply": it.output_text,
            "tool_calls": it.tool_calls,
            "finish_reason": it.finish_reason,
            "reward": r,
            "started_s": it.started_s,
            "ended_s": it.ended_s,
            "max_tokens": it.max_tokens,
            "requested_max_tokens": it.requested_max_tokens,
        }
        for it, r in zip(interactions, rewards, strict=True)
    ]


def _chain(
    calls: list[Interaction], decode: Callable[[list[int]], str] | None
) -> tuple[list[list[Interaction]], list[str]]:
    """Split calls into maximal runs where each prompt extends the previous prompt+output,
    with the reason for each split."""
    chains: list[list[Interaction]] = []
    reasons: list[str] = []
    tokens: list[int] = []
    for k, it in enumerate(calls):
        if not chains or it.prompt_ids[: len(tokens)] != tokens:
            if chains:
                reasons.append(_break_reason(k, tokens, it.prompt_ids, decode))
            chains.append([])
        chains[-1].append(it)
        tokens = it.prompt_ids + it.output_ids
    return chains, reasons


def _break_reason(
    k: int, before: list[int], prompt: list[int], decode: Callable[[list[int]], str] | None
) -> str:
    """Why call k's prompt does not extend the tokens of the calls before it."""
    at = next(
        (i for i, (a, b) in enumerate(zip(before, prompt, strict=False)) if a != b),
        len(prompt),
    )
    if at == len(prompt):
        return (
            f"call {k + 1}'s prompt ({len(prompt)} tokens) is shorter than the "
            f"{len(before)} tokens before it: the agent dropped or rewrote history"
        )
    if decode is None:
        sampled, rendered = before[at : at + 6], prompt[at : at + 6]
    else:  # token by token, so a different split of the same text shows
        sampled = [decode([t]) for t in before[at : at + 6]]
        rendered = [decode([t]) for t in prompt[at : at + 6]]
    why = ""
    if decode is not None and decode(prompt[at:]).startswith(decode(before[at:])):
        why = (
            " (the same text split into other tokens: re-tokenizing it does not give the "
            "ids sampled)"
        )
    return (
        f"call {k + 1}'s prompt differs from what was sampled before it at token {at}: "
        f"sampled {sampled}, re-rendered {rendered}{why}"
    )


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
        truncated=any(it.finish_reason == "length" for it in chain),
        longest_call_tokens=max(len(it.output_ids) for it in chain),
    )
