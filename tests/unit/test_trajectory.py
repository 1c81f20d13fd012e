import pytest
import torch

from looprl.rollout.trajectory import build_trajectories, call_records
from looprl.types import Interaction, Trajectory


def call(cid, prompt, output, version=0, finish_reason="stop"):
    return Interaction(
        completion_id=cid,
        prompt_ids=prompt,
        output_ids=output,
        logprobs=[-0.5 - i for i in range(len(output))],
        versions=[version] * len(output),
        finish_reason=finish_reason,
    )


def test_single_call_mask_is_one_exactly_on_sampled_tokens():
    (traj,), stats, _ = build_trajectories([call("a", [1, 2, 3], [7, 8])], 1.0)
    assert traj.input_ids.tolist() == [1, 2, 3, 7, 8]
    assert traj.loss_mask.tolist() == [False, False, False, True, True]
    assert traj.loss_mask.dtype == torch.bool and traj.loss_mask.is_contiguous()
    assert traj.behavior_logprobs.tolist() == [0, 0, 0, -0.5, -1.5]
    assert traj.versions.tolist() == [-1, -1, -1, 0, 0]
    assert traj.reward == 1.0
    assert stats["concat_breaks"] == 0


def test_concat_masks_the_tokens_between_calls():
    # second prompt = first prompt + first output + tool result [20, 21]
    calls = [call("a", [1, 2], [5, 6], version=3), call("b", [1, 2, 5, 6, 20, 21], [9], 4)]
    (traj,), stats, reasons = build_trajectories(calls, 0.5, "concat")
    assert traj.input_ids.tolist() == [1, 2, 5, 6, 20, 21, 9]
    assert traj.loss_mask.int().tolist() == [0, 0, 1, 1, 0, 0, 1]
    assert traj.loss_mask.is_contiguous()
    assert traj.versions.tolist() == [-1, -1, 3, 3, -1, -1, 4]
    assert traj.behavior_logprobs.tolist() == [0, 0, -0.5, -1.5, 0, 0, -0.5]
    assert stats["concat_breaks"] == 0 and reasons == []


def test_truncation_and_length_come_from_the_calls():
    # A concatenated sample: 2 + 3 sampled tokens, the second call cut off at its limit.
    first = call("a", [1, 2], [5, 6])
    second = call("b", [1, 2, 5, 6, 20], [9, 10, 11], finish_reason="length")
    (traj,), _, _ = build_trajectories([first, second], 1.0, "concat")
    assert traj.truncated is True
    assert traj.longest_call_tokens == 3  # the longest call's, not 2 + 3
    # Per call: only the cut-off call's sample is truncated.
    samples, _, _ = build_trajectories([first, second], 1.0, "per_call")
    assert [(s.truncated, s.longest_call_tokens) for s in samples] == [(False, 2), (True, 3)]
    # A sample built by hand is one call: its sampled tokens.
    assert samples[0].num_sampled_tokens == 2
    hand = Trajectory(
        input_ids=torch.tensor([1, 2, 3]),
        loss_mask=torch.tensor([False, True, True]),
        behavior_logprobs=torch.zeros(3),
        versions=torch.zeros(3, dtype=torch.int64),
        reward=0.0,
    )
    assert hand.truncated is False and hand.longest_call_tokens == 2


def test_concat_breaks_where_the_prompt_does_not_extend_the_chain():
    # the agent rewrote history: second prompt does not start with [1, 2, 5, 6]
    calls = [call("a", [1, 2], [5, 6]), call("b", [1, 2, 5, 7, 20], [9])]
    samples, stats, (reason,) = build_trajectories(calls, 1.0, "concat")
    assert [s.input_ids.tolist() for s in samples] == [[1, 2, 5, 6], [1, 2, 5, 7, 20, 9]]
    assert [s.loss_mask.int().tolist() for s in samples] == [[0, 0, 1, 1], [0, 0, 0, 0, 0, 1]]
    assert stats["concat_breaks"] == 1 and stats["concat_broken_sessions"] == 1
    assert reason == (
        "call 2's prompt differs from what was sampled before it at token 3: "
        "sampled [6], re-rendered [7, 20]"
    )


def test_a_break_reason_decodes_tokens_and_names_dropped_history():
    calls = [call("a", [1, 2], [5, 6]), call("b", [1, 2, 5], [9])]
    decode = lambda ids: "".join(chr(96 + i) for i in ids)  # noqa: E731
    _, _, (reason,) = build_trajectories(calls, 1.0, decode=decode)
    assert reason == (
        "call 2's prompt (3 tokens) is shorter than the 4 tokens before it: "
        "the agent dropped or rewrote history"
    )
    calls[1].prompt_ids = [1, 2, 5, 7]
    _, _, (reason,) = build_trajectories(calls, 1.0, decode=decode)
    assert reason.endswith("at token 3: sampled ['f'], re-rendered ['g']")
    # the same text in other tokens: "ef" sampled as e + f, re-rendered as one token
    joined = lambda ids: "".join({27: "ef"}.get(i, chr(96 + i)) for i in ids)  # noqa: E731
    calls[1].prompt_ids = [1, 2, 27, 8]
    _, _, (reason,) = build_trajectories(calls, 1.0, decode=joined)
    assert reason.endswith(
        "at token 2: sampled ['e', 'f'], re-rendered ['ef', 'h'] (the same text split into "
        "other tokens: re-tokenizing it does not give the ids sampled)"
    )


def test_a_rollout_reward_is_broadcast_discounted_or_given_to_the_last_call():
    # three calls; call c does not extend b's tokens, so concat makes [a, b] and [c]
    calls = [call("a", [1], [5]), call("b", [1, 5, 7], [8]), call("c", [3], [4])]
    per_call = lambda **kw: [s.reward for s in build_trajectories(calls, 2.0, "per_call", **kw)[0]]  # noqa: E731
    assert per_call() == [2.0, 2.0, 2.0]
    assert per_call(discount=0.5) == [0.5, 1.0, 2.0]  # 2 * 0.5**2, 2 * 0.5, 2
    assert per_call(assignment="last_call", discount=0.5) == [0.0, 0.0, 2.0]
    concat, _, _ = build_trajectories(calls, 2.0, "concat", discount=0.5)
    assert [s.reward for s in concat] == [1.0, 2.0]  # a chain gets its last call's reward
    concat, _, _ = build_trajectories(calls, 2.0, "concat", assignment="last_call")
    assert [s.reward for s in concat] == [0.0, 2.0]


def test_per_call_mode_and_reward_dict():
    calls = [call("a", [1, 2], [5, 6]), call("b", [1, 2, 5, 6, 20], [9]), call("c", [3], [4])]
    samples, _, _ = build_trajectories(calls, 2.0, "per_call")
    assert [s.input_ids.tolist() for s in samples] == [[1, 2, 5, 6], [1, 2, 5, 6, 20, 9], [3, 4]]
    assert [s.loss_mask.int().tolist() for s in samples][1] == [0, 0, 0, 0, 0, 1]
    samples, stats, _ = build_trajectories(calls, {"a": 1.0, "c": -1.0}, "concat", discount=0.5)
    assert [(s.input_ids.tolist(), s.reward) for s in samples] == [
        ([1, 2, 5, 6], 1.0),
        ([3, 4], -1.0),
    ]
    assert stats["unrewarded_calls"] == 1


def test_empty_outputs_are_dropped_and_counted():
    samples, stats, _ = build_trajectories([call("a", [1, 2], [])], 1.0)
    assert samples == [] and stats["empty_calls"] == 1


def test_trajectory_rejects_a_mask_on_the_first_token():
    with pytest.raises(ValueError, match=r"loss_mask\[0\]"):
        Trajectory(
            input_ids=torch.tensor([1, 2]),
            loss_mask=torch.tensor([True, True]),
            behavior_logprobs=torch.zeros(2),
            versions=torch.zeros(2, dtype=torch.int64),
            reward=0.0,
        )


def test_json_round_trip():
    # Two calls, 2 + 3 sampled tokens, the second cut off: longest call 3 of 5 tokens.
    calls = [call("a", [1, 2], [5, 6]), call("b", [1, 2, 5, 6], [9, 10, 11], 0, "length")]
    (traj,), _, _ = build_trajectories(calls, 1.0, group_id="g")
    back = Trajectory.from_json(traj.to_json())
    assert torch.equal(back.input_ids, traj.input_ids)
    assert torch.equal(back.loss_mask, traj.loss_mask)
    assert back.group_id == "g"
    assert back.truncated is True and back.longest_call_tokens == 3
    # A row written before these fields existed: not truncated, one call of 5 tokens.
    old = {k: v for k, v in traj.to_json().items() if k not in ("truncated", "longest_call_tokens")}
    assert Trajectory.from_json(old).truncated is False
    assert Trajectory.from_json(old).longest_call_tokens == 5


def test_call_records_give_each_call_its_share_of_the_reward():
    calls = [call("a", [1], [5]), call("empty", [1, 5], []), call("b", [1, 5, 6], [7])]
    calls[0].messages = [{"role": "user", "content": "hi"}]
    calls[0].tool_calls = [{"id": "c0", "type": "function"}]
    records = call_records(calls, 1.0, assignment="broadcast", discount=0.5)
    # Two calls sampled: the earlier gets 1.0 * 0.5 ** 1, the empty one nothing.
    assert [r["reward"] for r in records] == [0.5, None, 1.0]
    assert records[0]["messages"] == [{"role": "user", "content": "hi"}]
    assert records[0]["tool_calls"] == [{"id": "c0", "type": "function"}]
    assert records[2]["messages"] == [] and records[2]["tool_calls"] == []
    assert [r["completion_id"] for r in records] == ["a", "empty", "b"]
    last = call_records(calls, 1.0, assignment="last_call")
    assert [r["reward"] for r in last] == [0.0, None, 1.0]
    by_id = call_records(calls, {"b": 0.25})
    assert [r["reward"] for r in by_id] == [None, None, 0.25]
