import asyncio

from looprl.config import load_config
from looprl.loop import describe_loss
from looprl.workflows.protocol import close_workflow


def test_the_start_up_log_names_the_resolved_loss():
    # eps_clip left unset: the objective's own range is what the log shows.
    assert describe_loss(load_config()) == (
        "Loss: grpo advantages, ppo objective with its ratio clipped to [0.8, 1.2] "
        "(eps_clip=0.2, eps_clip_high=0.2), token_mean aggregation; behavior weight (token "
        "level) mis: weights outside [0, 5] masked; logprobs at temperature 1, top_k 0, "
        "top_p 1 (sampling's, forced on every training session)"
    )
    gspo = load_config(
        None,
        [
            "train.objective=gspo",
            "train.mismatch_correction=tis",
            "train.mismatch_level=geometric",
            "sampling.top_k=20",
            "sampling.top_p=0.9",
        ],
    )
    line = describe_loss(gspo)
    assert "gspo objective with its ratio clipped to [0.9997, 1.0004]" in line
    assert "behavior weight (geometric level) tis: truncated at 5" in line
    assert "top_k 20, top_p 0.9" in line
    # Greedy rollouts: the trainer takes the model's own distribution, untruncated.
    greedy = load_config(None, ["sampling.temperature=0", "sampling.top_k=20"])
    assert "temperature 1, top_k 0, top_p 1" in describe_loss(greedy)


async def test_close_workflow_calls_a_sync_or_async_close_once_and_skips_none():
    calls = []

    class SyncClose:
        def close(self):
            calls.append("sync")

    class AsyncClose:
        async def close(self):
            await asyncio.sleep(0)
            calls.append("async")

    class NoClose:
        close = None  # an attribute named close that is not a method is left alone

    for workflow in (SyncClose(), AsyncClose(), NoClose(), object()):
        await close_workflow(workflow)
    assert calls == ["sync", "async"]


def test_the_loss_line_names_a_credit_and_bonus_that_are_not_the_defaults():
    line = describe_loss(
        load_config(
            None,
            ["train.credit=gae", "train.gamma=0.9", "train.entropy_coef=0.01",
             "train.entropy_floor=0.3"],
        )
    )  # fmt: skip
    assert line.startswith(
        "Loss: grpo advantages (turns credited by gae: gamma 0.9, lambda 0.95), entropy "
        "bonus 0.01 when the batch entropy is below 0.3, ppo objective"
    )


def test_actions_are_counted_only_where_a_rollout_made_several_calls():
    from looprl.loop import multi_turn_actions
    from looprl.rollout.outcome import RolloutOutcome, RolloutResult

    def outcome(*replies):
        return RolloutOutcome("g", "completed", calls=[{"reply": r} for r in replies])

    single = RolloutResult([outcome("7"), outcome("12")], elapsed_s=1.0)
    assert multi_turn_actions(single) == {}
    multi = RolloutResult([outcome("right", "Down."), outcome("right")], elapsed_s=1.0)
    stats = multi_turn_actions(multi)
    assert stats["action_share_right"] == 2 / 3 and stats["action_share_down"] == 1 / 3
