"""End to end: on-policy distillation (train.algorithm=distill) from a teacher trained by
the toy job (tests/support/toy_job.py), through the real loop, gateway, engine and trainer.
Not a kernels test: its numerics are the trainer's, which test_learning.py covers on
both CPUs."""

from __future__ import annotations

import json

import pytest

from looprl.loop import train
from tests.support.toy_job import learned_steps, toy_job


@pytest.mark.slow
async def test_a_student_learns_from_a_teacher_by_distillation(peaked_model_dir, tmp_path):
    """train.algorithm=distill: the teacher is the toy job's output; the student, the
    untrained model, gets no reward signal (its advantages are the teacher's per-token
    logprobs minus its own), yet its reward rises toward the teacher's as its reverse KL
    to the teacher falls."""
    teacher = toy_job(peaked_model_dir, tmp_path / "teacher")
    await train(teacher, show_progress=False)
    teacher_reward = learned_steps(teacher, "teacher")[-1]["reward_mean"]

    cfg = toy_job(
        peaked_model_dir,
        tmp_path / "student",
        "train.algorithm=distill",
        f"train.teacher_path={teacher.run_dir / 'model'}",
        "train.total_steps=12",
        # At the toy job's 3e-3, and again at 1.5e-3 (CI, stop 45), a student overshot
        # into all odd tokens by step 3, a mode it saturates (p -> 1, so log p's
        # gradient vanishes, and every sampled token's advantage is the batch's
        # baseline) and never left: reverse KL stuck at 14.3 for ten steps. At 7e-4 the
        # KL fell without a dip in 5 of 5 runs (from ~30 to < 1 by step 6 or 7).
        "train.lr=7e-4",
    )
    await train(cfg, show_progress=False)
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").open()]
    steps = [r for r in records if r["kind"] == "train"]
    kls = [round(r["distill_kl"], 3) for r in steps]
    rewards = [round(r["reward_mean"], 3) for r in steps]
    print("distillation: KL to the teacher", kls, "rewards", rewards, "teacher", teacher_reward)
    # When it catches up varies from run to run (step 3 to 7 seen): asked is that after
    # three steps it got closer to the teacher, against its first step (sampled before any
    # update), not when, nor how close. Most runs reach a KL under 1; CI (stop 48) saw one
    # collapse (entropy 0.002) onto one even reply by step 4, a mode sampled-token
    # distillation cannot leave (p -> 1 zeroes log p's gradient): reward 1.0, KL stuck at
    # 0.59 of its first. A student that does not learn keeps its first KL within noise;
    # one pushed away (the advantage's sign flipped) raises it.
    assert len(steps) == 12
    assert min(kls[3:]) < 0.75 * kls[0], kls
    assert max(rewards[3:]) > rewards[0] + 0.3, rewards
