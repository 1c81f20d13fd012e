"""One step's rollouts, batch and trainer logprobs, small enough to check by hand, for
the trajectory file tests (tests/unit/test_trajectory_files.py) and `looprl show`'s
(tests/unit/test_show.py)."""

from __future__ import annotations

import math

import torch

from looprl.rollout.outcome import RolloutOutcome, RolloutResult
from looprl.rollout.trajectory import build_trajectories, call_records
from looprl.training.batch import build_batch
from looprl.types import Interaction


def call(cid, prompt, output, version, messages=None):
    return Interaction(
        completion_id=cid,
        prompt_ids=prompt,
        output_ids=output,
        logprobs=[-0.5] * len(output),
        versions=[version] * len(output),
        finish_reason="stop",
        output_text=f"reply {cid}",
        messages=messages,
        started_s=100.0,
        ended_s=101.5,
    )


def outcome(interactions, reward, group_id, session_id, sample_index, row_id="7"):
    trajectories, _, breaks = build_trajectories(
        interactions, reward, group_id=group_id, session_id=session_id
    )
    return RolloutOutcome(
        group_id,
        "completed",
        trajectories=trajectories,
        reward=reward,
        elapsed_s=2.0,
        started=0.0,
        row_id=row_id,
        sample_index=sample_index,
        calls=call_records(interactions, reward),
        concat_breaks=breaks,
    )


def step_fixture():
    """Group g1: rollout A (2 calls whose concatenation breaks: 2 samples, reward 1) and
    rollout B (reward 0); group g2: rollout C alone (reward 0.5). Batch rows A1 A2 B C."""
    hello = [{"role": "user", "content": "hello"}]
    a = outcome(
        [call("a1", [1, 2], [5, 6], 3, hello), call("a2", [1, 9, 9], [8], 4, hello)],
        1.0,
        "g1",
        "sA",
        0,
    )
    b = outcome([call("b1", [1, 2], [7], 4)], 0.0, "g1", "sB", 1)
    c = outcome([call("c1", [3], [4, 4], 4)], 0.5, "g2", "sC", 0, row_id="8")
    rollout = RolloutResult([a, b, c], elapsed_s=3.0)
    batch, _ = build_batch(rollout.trajectories, "grpo", pad_token_id=0)
    trainer = torch.full(batch.input_ids.shape, -0.25)  # (4, 4)
    trainer[2, 2] = math.nan  # row B: not computed by the trainer
    return rollout, batch, trainer


def token_text(ids):
    return [f"<{i}>" for i in ids]
