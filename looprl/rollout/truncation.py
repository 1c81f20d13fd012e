"""Truncation: which model calls stopped at their token limit, and what limit that was.

Owns `truncation_stats`: over a batch's rollouts, the model calls whose finish_reason
was "length" and, for the call position cut most often (the k-th model call of a
rollout), the limit those calls ran under and the max_tokens the agent's request asked
for. Reads the call records of the rollout outcomes (trajectory.call_records); what a
warning says about them is diagnostics/learning.py's.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from looprl.rollout.outcome import RolloutOutcome


def truncation_stats(outcomes: list[RolloutOutcome]) -> dict[str, Any]:
    """`truncated_calls` and `truncated_call_share` (of every model call of the
    outcomes); when some call was cut, for the position k cut in the largest share of its
    calls (ties: the most cut, then the first): `truncated_turn` (k, 1-based),
    `truncated_turn_calls` (the calls at k), `truncated_turn_share` (the share of them
    cut), `truncated_turn_max_tokens` (the limit most of its cut calls ran under) and
    `truncated_turn_requested_max_tokens` (what their request asked for; None: the agent
    passed no max_tokens). Empty without calls."""
    calls = [(k, call) for o in outcomes for k, call in enumerate(o.calls, start=1)]
    if not calls:
        return {}
    cut = [(k, call) for k, call in calls if call["finish_reason"] == "length"]
    stats: dict[str, Any] = {
        "truncated_calls": len(cut),
        "truncated_call_share": len(cut) / len(calls),
    }
    if not cut:
        return stats
    at = Counter(k for k, _ in calls)
    cut_at = Counter(k for k, _ in cut)  # in order of first appearance: ties keep the first
    turn = max(cut_at, key=lambda k: (cut_at[k] / at[k], cut_at[k], -k))
    limits = Counter(
        (call.get("max_tokens"), call.get("requested_max_tokens")) for k, call in cut if k == turn
    )
    (limit, requested), _ = limits.most_common(1)[0]
    stats.update(
        truncated_turn=turn,
        truncated_turn_calls=at[turn],
        truncated_turn_share=cut_at[turn] / at[turn],
        truncated_turn_max_tokens=limit,
        truncated_turn_requested_max_tokens=requested,
    )
    return stats
