"""truncation_stats over hand-built call records: the share of calls cut, and the call
position cut most with the limit it ran under and the one its request asked for."""

from __future__ import annotations

from looprl.rollout.outcome import RolloutOutcome
from looprl.rollout.truncation import truncation_stats


def call(finish: str, limit: int = 48, requested: int | None = None) -> dict:
    return {"finish_reason": finish, "max_tokens": limit, "requested_max_tokens": requested}


def outcome(*calls: dict) -> RolloutOutcome:
    return RolloutOutcome("g", "completed", calls=list(calls))


def test_the_second_call_cut_at_the_agents_max_tokens_is_named():
    outcomes = [
        outcome(call("stop", 256), call("length", 8, 8)),
        outcome(call("length", 256), call("length", 8, 8)),
        outcome(call("stop", 256), call("stop", 8, 8)),
        outcome(call("stop", 256)),  # ended after one call
    ]
    assert truncation_stats(outcomes) == {
        "truncated_calls": 3,
        "truncated_call_share": 3 / 7,
        "truncated_turn": 2,
        "truncated_turn_calls": 3,
        "truncated_turn_share": 2 / 3,
        "truncated_turn_max_tokens": 8,
        "truncated_turn_requested_max_tokens": 8,
    }


def test_no_cut_call_gives_the_counts_only_and_no_call_nothing():
    assert truncation_stats([outcome(call("stop"))]) == {
        "truncated_calls": 0,
        "truncated_call_share": 0.0,
    }
    assert truncation_stats([RolloutOutcome("g", "failed")]) == {}


def test_equal_shares_pick_the_position_with_more_cut_calls_then_the_first():
    outcomes = [outcome(call("length"), call("length")), outcome(call("length"))]
    assert truncation_stats(outcomes)["truncated_turn"] == 1  # 2 of 2 beats 1 of 1
    outcomes = [outcome(call("length"), call("length"))]
    assert truncation_stats(outcomes)["truncated_turn"] == 1
