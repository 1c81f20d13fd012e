"""train.credit over the turns of multi-turn rollouts, every figure computed by hand.

The running example: one group of two rollouts of two turns each (calls in the order
A1, A2, B1, B2). A steps 0 then reaches the goal (1); B gets nothing. With the workflow's
discount 0.5 the calls' returns-to-go (what a workflow hands back per call) are
A: [0.5, 1], B: [0, 0]; the episode returns A 1, B 0.
"""

from __future__ import annotations

import pytest
import torch

from looprl.rollout.trajectory import build_trajectories
from looprl.training.advantages import Episodes, credit_advantages
from looprl.training.batch import build_batch, turn_stats
from looprl.types import Interaction
from tests.support.batches import toy_trajectory

GROUP = torch.tensor([0, 0, 0, 0])
TO_GO = torch.tensor([0.5, 1.0, 0.0, 0.0])
EPISODES = Episodes(
    episode_index=torch.tensor([0, 0, 1, 1]),
    turn=torch.tensor([1, 2, 1, 2]),
    episode_return=torch.tensor([1.0, 1.0, 0.0, 0.0]),
    step_reward=torch.tensor([0.0, 1.0, 0.0, 0.0]),
)


def advantages(credit, algorithm="dr_grpo", episodes=EPISODES, group=GROUP, **kw):
    values, stats = credit_advantages(credit, algorithm, TO_GO, group, episodes, **kw)
    return values.tolist(), stats


def test_per_call_baselines_every_call_of_the_group():
    # mean of [0.5, 1, 0, 0] is 0.375
    assert advantages("per_call")[0] == pytest.approx([0.125, 0.625, -0.375, -0.375])


def test_per_turn_baselines_each_turn_against_the_same_turn():
    # turn 1: [0.5, 0], mean 0.25; turn 2: [1, 0], mean 0.5
    values, stats = advantages("per_turn")
    assert values == pytest.approx([0.25, 0.5, -0.25, -0.5])
    assert stats["num_groups"] == 2  # (group, turn) pairs


def test_per_turn_gives_a_turn_no_other_rollout_reached_no_baseline():
    # B ended after one turn: A's second call has no one to compare with.
    episodes = Episodes(
        torch.tensor([0, 0, 1]),
        torch.tensor([1, 2, 1]),
        torch.tensor([1.0, 1.0, 0.0]),
        torch.tensor([0.0, 1.0, 0.0]),
    )
    values, _ = credit_advantages(
        "per_turn", "dr_grpo", torch.tensor([0.5, 1.0, 0.0]), torch.tensor([0, 0, 0]), episodes
    )
    assert values.tolist() == pytest.approx([0.25, 0.0, -0.25])


def test_episode_broadcasts_the_episode_advantage_to_every_call():
    # episode returns [1, 0], mean 0.5, counted once per rollout, not once per call
    values, stats = advantages("episode")
    assert values == pytest.approx([0.5, 0.5, -0.5, -0.5])
    assert stats["num_groups"] == 1 and stats["degenerate_groups"] == 0
    # grpo divides by the unbiased std of [1, 0], 0.7071
    values, _ = advantages("episode", "grpo")
    assert values == pytest.approx([0.7071, 0.7071, -0.7071, -0.7071], abs=1e-4)


def test_episode_weighs_rollouts_not_calls():
    # A has three calls, B one: per rollout the mean is 0.5, not (3 x 1 + 0) / 4 = 0.75.
    episodes = Episodes(
        torch.tensor([0, 0, 0, 1]),
        torch.tensor([1, 2, 3, 1]),
        torch.tensor([1.0, 1, 1, 0]),
        torch.tensor([0.0, 0, 1, 0]),
    )
    values, _ = credit_advantages(
        "episode", "dr_grpo", torch.tensor([1.0, 1, 1, 0]), torch.tensor([0, 0, 0, 0]), episodes
    )
    assert values.tolist() == pytest.approx([0.5, 0.5, 0.5, -0.5])


def test_gae_lambda_one_is_the_discounted_return_minus_the_turns_mean():
    # gamma 1: returns A [1, 1], B [0, 0]; V(1) = V(2) = 0.5
    values, stats = advantages("gae", gamma=1.0, gae_lambda=1.0)
    assert values == pytest.approx([0.5, 0.5, -0.5, -0.5])
    assert stats["degenerate_groups"] == 0


def test_gae_lambda_zero_is_the_one_step_td_error():
    # gamma 0.5: returns A [0.5, 1], B [0, 0]; V(1) = 0.25, V(2) = 0.5.
    # A2: 1 - 0.5 = 0.5; A1: 0 + 0.5 x 0.5 - 0.25 = 0; B2: 0 - 0.5; B1: 0.25 - 0.25 = 0.
    values, _ = advantages("gae", gamma=0.5, gae_lambda=0.0)
    assert values == pytest.approx([0.0, 0.5, 0.0, -0.5])


def test_gae_between_passes_part_of_the_later_error_back():
    # lambda 0.5: A1 = 0 + 0.5 x 0.5 x A2 = 0.125, B1 = 0.25 x -0.5 = -0.125
    values, _ = advantages("gae", gamma=0.5, gae_lambda=0.5)
    assert values == pytest.approx([0.125, 0.5, -0.125, -0.5])
    # grpo whitens by the population std over the batch: sqrt((2 x 0.125^2 + 2 x 0.25) / 4)
    std = ((2 * 0.125**2 + 2 * 0.5**2) / 4) ** 0.5
    values, _ = advantages("gae", "grpo", gamma=0.5, gae_lambda=0.5)
    assert values == pytest.approx([0.125 / std, 0.5 / std, -0.125 / std, -0.5 / std], rel=1e-4)


def test_gae_of_rollouts_with_the_same_rewards_is_exactly_zero():
    episodes = Episodes(
        torch.tensor([0, 0, 1, 1]),
        torch.tensor([1, 2, 1, 2]),
        torch.tensor([0.3, 0.3, 0.3, 0.3]),
        torch.tensor([0.1, 0.2, 0.1, 0.2]),
    )
    values, stats = advantages("gae", episodes=episodes, gamma=0.9, gae_lambda=0.95)
    assert values == [0.0, 0.0, 0.0, 0.0]
    assert stats["degenerate_groups"] == 1


def test_gae_keeps_groups_apart():
    # The example's group 0, and a group 1 whose one rollout has no one to compare with.
    episodes = Episodes(
        torch.tensor([0, 0, 1, 1, 2]),
        torch.tensor([1, 2, 1, 2, 1]),
        torch.tensor([1.0, 1.0, 0.0, 0.0, 5.0]),
        torch.tensor([0.0, 1.0, 0.0, 0.0, 5.0]),
    )
    values, stats = credit_advantages(
        "gae",
        "dr_grpo",
        torch.tensor([0.5, 1.0, 0.0, 0.0, 5.0]),
        torch.tensor([0, 0, 0, 0, 1]),
        episodes,
        gamma=1.0,
        gae_lambda=1.0,
    )
    assert values.tolist() == pytest.approx([0.5, 0.5, -0.5, -0.5, 0.0])
    assert stats["num_groups"] == 2 and stats["degenerate_groups"] == 1


@pytest.mark.parametrize("credit", ["per_turn", "episode", "gae"])
def test_distill_takes_no_credit_over_turns(credit):
    values, _ = credit_advantages(credit, "distill", TO_GO, GROUP, EPISODES)
    assert values.tolist() == [0.0, 0.0, 0.0, 0.0]


def call(cid, prompt, output):
    return Interaction(cid, prompt, output, [-0.5] * len(output), [0] * len(output), "stop")


def test_samples_hold_their_turn_episode_return_and_step_reward():
    calls = [call("a", [1], [5]), call("b", [1, 5, 7], [8]), call("c", [3], [4])]
    # A dict of returns-to-go with the immediate rewards beside it.
    samples, _, _ = build_trajectories(
        calls,
        {"a": 0.5, "b": 0.0, "c": 1.0},
        episode_return=1.0,
        step_rewards={"a": 0.0, "b": -0.5, "c": 1.0},
    )
    assert [(s.turn, s.reward, s.step_reward, s.episode_return) for s in samples] == [
        (1, 0.5, 0.0, 1.0),
        (2, 0.0, -0.5, 1.0),
        (3, 1.0, 1.0, 1.0),
    ]
    # A float reward: the outcome comes at the end, so only the last call's sample has it.
    samples, _, _ = build_trajectories(calls, 2.0, "per_call", discount=0.5)
    assert [(s.turn, s.step_reward, s.episode_return) for s in samples] == [
        (1, 0.0, 2.0),
        (2, 0.0, 2.0),
        (3, 2.0, 2.0),
    ]
    # Concatenated: [a, b] (b extends a) starts at turn 1, [c] at turn 3.
    samples, _, _ = build_trajectories(calls, 2.0, "concat")
    assert [(s.turn, s.step_reward) for s in samples] == [(1, 0.0), (3, 2.0)]


def episode_samples():
    """The running example as trajectories: sampled tokens 2 per call (A1, B2) or 1."""
    shapes = [("A", 1, 0.5, 0.0, 4), ("A", 2, 1.0, 1.0, 3), ("B", 1, 0.0, 0.0, 3),
              ("B", 2, 0.0, 0.0, 4)]  # fmt: skip
    samples = []
    for session, turn, to_go, step, length in shapes:
        t = toy_trajectory(length, 2, to_go, "g")
        t.session_id, t.turn, t.step_reward = session, turn, step
        t.episode_return = 1.0 if session == "A" else 0.0
        samples.append(t)
    return samples


def test_build_batch_credits_turns_and_reports_them_per_turn():
    batch, stats = build_batch(episode_samples(), "dr_grpo", 0, credit="per_turn")
    assert batch.advantages.tolist() == pytest.approx([0.25, 0.5, -0.25, -0.5])
    assert batch.turn.tolist() == [1, 2, 1, 2]
    assert stats["degenerate_group_share"] == 0.0
    # |A| x sampled tokens: turn 1 0.25 x 2 + 0.25 x 1 = 0.75, turn 2 0.5 x 1 + 0.5 x 2 = 1.5
    assert stats["turn1_loss_share"] == pytest.approx(0.75 / 2.25)
    assert stats["turn2_loss_share"] == pytest.approx(1.5 / 2.25)
    assert stats["turn1_return_mean"] == pytest.approx(0.25)
    assert stats["turn2_return_mean"] == pytest.approx(0.5)
    assert stats["turn2_advantage_mean"] == pytest.approx(0.0)
    assert stats["turn2_advantage_abs_mean"] == pytest.approx(0.5)
    assert stats["turn1_samples"] == 2
    batch, _ = build_batch(episode_samples(), "dr_grpo", 0, credit="episode")
    assert batch.advantages.tolist() == pytest.approx([0.5, 0.5, -0.5, -0.5])


def test_single_turn_batches_log_no_turn_figures_and_count_equal_groups():
    samples = [
        toy_trajectory(3, 1, r, g) for r, g in ((1.0, "x"), (1.0, "x"), (0.0, "y"), (1.0, "y"))
    ]
    _, stats = build_batch(samples, "grpo", 0)
    assert not any(key.startswith("turn") for key in stats)
    assert stats["degenerate_group_share"] == 0.5  # group x: both 1


def test_turn_stats_loss_share_is_zero_without_advantages():
    batch, _ = build_batch(episode_samples(), "dr_grpo", 0)
    batch.advantages.zero_()
    stats = turn_stats(batch)
    assert stats["turn1_loss_share"] == 0.0 and stats["turn2_loss_share"] == 0.0


def test_a_concatenated_rollout_reports_each_call_at_its_own_turn():
    # Two two-call rollouts of one group, each concatenated into one sample: a first reply
    # of 3 tokens, the follow-up [7] masked, a last reply of 1. Rewards 1 and 0 (GRPO with
    # std: advantages +-0.7071). The same rollouts as separate samples (per_call) must
    # report the same per-turn figures.
    def rollout(session, reward, mode):
        calls = [call("a", [1, 2], [5, 6, 9]), call("b", [1, 2, 5, 6, 9, 7], [8])]
        samples, _, _ = build_trajectories(calls, reward, mode, group_id="g", session_id=session)
        return samples

    for mode in ("concat", "per_call"):
        samples = rollout("A", 1.0, mode) + rollout("B", 0.0, mode)
        batch, stats = build_batch(samples, "grpo", 0, credit="episode")
        assert len(samples) == (2 if mode == "concat" else 4)
        assert batch.token_turns.max() == 2
        assert stats["turn1_samples"] == 2 and stats["turn2_samples"] == 2
        assert stats["turn1_tokens"] == 3 and stats["turn2_tokens"] == 1
        # |A| x tokens: each first reply 3 x 0.7071, each last 1 x 0.7071: shares 3/4, 1/4
        assert stats["turn1_loss_share"] == pytest.approx(0.75)
        assert stats["turn2_loss_share"] == pytest.approx(0.25)
        assert stats["turn2_advantage_abs_mean"] == pytest.approx(0.7071, abs=1e-4)
        assert stats["turn2_return_mean"] == pytest.approx(0.5)
        # Under turn_token_mean each call position weighs by its calls: half each.
        _, stats = build_batch(samples, "grpo", 0, credit="episode", loss_agg="turn_token_mean")
        assert stats["turn1_loss_share"] == pytest.approx(0.5)
        assert stats["turn2_loss_share"] == pytest.approx(0.5)
    # In the concatenated sample the follow-up token [7] is at no call (0).
    assert build_batch(rollout("A", 1.0, "concat"), "grpo", 0)[0].token_turns.tolist() == [
        [0, 0, 1, 1, 1, 0, 2]
    ]
