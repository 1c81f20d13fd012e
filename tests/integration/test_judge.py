"""reward.type=judge over real HTTP with the real `openai` client: a scripted judge
server (tests/support/scripted_judge.py) for parsing, group scoring, caching, timeouts,
retries and failures; looprl's own second engine serving the tiny model for the default
path; and a two-step training run judged by it."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from looprl import startup
from looprl.commands.collect import collect
from looprl.config import EngineConfig, JudgeConfig, load_config
from looprl.rewards import build_reward
from looprl.rewards.judge import JudgeReward, parse_group_scores, parse_score
from looprl.rewards.judge_server import serve_judge
from looprl.tasks import load_task
from tests.support.scripted_judge import ScriptedJudge
from tests.support.tiny_run import train_and_read

ROW = {"question": "What is 2 + 2?", "answer": "4"}


def judge(base_url: str, **options) -> JudgeReward:
    cfg = JudgeConfig(**{"backoff_s": 0.0, **options})
    return JudgeReward(cfg, base_url=base_url, api_key="k", model="judge", answer_field="answer")


async def score_one(reward: JudgeReward, completion: str, row: dict = ROW) -> float | None:
    async with reward.rollout(row) as score:
        return await score(row["question"], completion)


def by_content(prompt: str) -> str:
    """Absolute: 9 for an answer saying 4, else 1."""
    answer = prompt.split("Answer to rate:\n", 1)[1]
    return "Score: 9" if "4" in answer.split("\n\nReply")[0] else "Score: 1"


def test_parsing():
    assert parse_score("Reasoning... Score: 7") == 0.7
    assert parse_score("score=10") == 1.0
    assert parse_score("It deserves 3.") == 0.3
    assert parse_score("Score: 11") is None and parse_score("") is None
    assert parse_group_scores("Candidate 2: 4\nCandidate 1: 9", 2) == [0.9, 0.4]
    assert parse_group_scores("Candidate 1: 9", 2) is None


async def test_absolute_scores_and_the_cache():
    server = ScriptedJudge(by_content)
    async with server.serve() as url:
        reward = judge(url)
        assert await score_one(reward, "It is 4.") == 0.9
        assert await score_one(reward, "It is 5.") == 0.1
        assert len(server.requests) == 2
        # The rubric got the question, the answer and the reference.
        assert (
            "What is 2 + 2?" in server.requests[0] and "Reference answer:\n4" in server.requests[0]
        )
        assert await score_one(reward, "It is 4.") == 0.9  # the cache: no request
        assert len(server.requests) == 2
        await reward.aclose()
    assert reward.take_stats() == {
        "reward_judge_calls": 2,
        "reward_judge_retries": 0,
        "reward_judge_failures": 0,
        "reward_judge_cache_hits": 1,
    }


def score_candidates(prompt: str) -> str:
    """Group: each candidate's score is its number of exclamation marks."""
    blocks = re.findall(r"Candidate (\d+):\n(.*?)(?=\n\nCandidate|\n\nReply)", prompt, re.DOTALL)
    return "\n".join(f"Candidate {i}: {text.count('!')}" for i, text in blocks)


async def test_group_mode_scores_a_group_in_one_call():
    server = ScriptedJudge(score_candidates)
    async with server.serve() as url:
        reward = judge(url, mode="group")
        row = dict(ROW)  # the group's rollouts share their row, as the controller's do

        async def rollout(completion: str, delay_s: float) -> float | None:
            async with reward.rollout(row) as score:
                await asyncio.sleep(delay_s)  # the model call
                return await score(row["question"], completion)

        async def crashing() -> None:
            async with reward.rollout(row):
                await asyncio.sleep(0.05)
                raise RuntimeError("the agent failed before scoring")

        results = await asyncio.gather(
            rollout("4!!!", 0.1),
            rollout("4", 0.0),
            rollout("four!!", 0.2),
            crashing(),
            return_exceptions=True,
        )
        assert results[:3] == [0.3, 0.0, 0.2]
        assert isinstance(results[3], RuntimeError)
        assert len(server.requests) == 1 and server.requests[0].count("Candidate") >= 3
        # Judged answers are cached: the same group again sends nothing.
        again = await asyncio.gather(rollout("4!!!", 0.0), rollout("4", 0.0))
        assert again == [0.3, 0.0] and len(server.requests) == 1
        await reward.aclose()
    stats = reward.take_stats()
    assert stats["reward_judge_calls"] == 1 and stats["reward_judge_cache_hits"] == 2


async def test_a_slow_judge_times_out_and_is_retried():
    replies = iter([2.0, "Score: 8"])  # a reply after 2 s, then a prompt one
    server = ScriptedJudge(lambda prompt: next(replies))
    async with server.serve() as url:
        reward = judge(url, timeout_s=0.5, retries=1)
        assert await score_one(reward, "It is 4.") == 0.8
        await reward.aclose()
    stats = reward.take_stats()
    assert stats["reward_judge_calls"] == 2 and stats["reward_judge_retries"] == 1
    assert stats["reward_judge_failures"] == 0


async def test_failures_are_counted_and_get_the_fallback():
    server = ScriptedJudge(lambda prompt: 500)
    async with server.serve() as url:
        reward = judge(url, retries=2, fallback_reward=0.25)
        assert await score_one(reward, "It is 4.") == 0.25
        assert len(server.requests) == 3  # the first call and two retries
        rejecting = judge(url, retries=0, fallback_reward=None)
        assert await score_one(rejecting, "It is 4.") is None  # rejects the rollout
        await reward.aclose()
        await rejecting.aclose()
    assert reward.take_stats()["reward_judge_failures"] == 1
    assert rejecting.take_stats()["reward_judge_failures"] == 1


async def test_unreadable_judgments_are_failures():
    server = ScriptedJudge(lambda prompt: "I cannot decide.")
    async with server.serve() as url:
        reward = judge(url, retries=1, fallback_reward=0.0)
        assert await score_one(reward, "It is 4.") == 0.0
        grouped = judge(url, mode="group", retries=0, fallback_reward=0.5)
        row = dict(ROW)

        async def rollout(completion: str) -> float | None:
            async with grouped.rollout(row) as score:
                return await score(row["question"], completion)

        assert await asyncio.gather(rollout("4"), rollout("5")) == [0.5, 0.5]
        await reward.aclose()
        await grouped.aclose()
    assert reward.take_stats()["reward_judge_failures"] == 1
    assert grouped.take_stats()["reward_judge_failures"] == 2
    assert not reward._cache  # a failure is not remembered


async def test_a_remote_judge_takes_its_key_from_the_environment(monkeypatch, tmp_path):
    server = ScriptedJudge(by_content)
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(ROW) + "\n")
    async with server.serve() as url:
        overrides = ["task.name=jsonl", f"task.train_path={data}", "reward.type=judge"]
        overrides += [f"reward.judge.base_url={url}", "reward.judge.model=gpt-judge"]
        overrides += ["reward.judge.api_key_env=MY_JUDGE_KEY"]
        cfg = load_config(None, overrides)
        monkeypatch.delenv("MY_JUDGE_KEY", raising=False)
        with pytest.raises(ValueError, match="MY_JUDGE_KEY"):
            build_reward(cfg, load_task(cfg.task))
        monkeypatch.setenv("MY_JUDGE_KEY", "secret")
        reward = build_reward(cfg, load_task(cfg.task))
        assert await score_one(reward, "4") == 0.9
        assert reward.client.api_key == "secret" and reward.model == "gpt-judge"
        await reward.aclose()


async def test_a_second_local_engine_judges(tiny_model_dir):
    """The default: looprl serves reward.judge.model itself. The tiny random model's
    replies are noise, so this is the failure path on a real engine: one call, its reply
    read as a score or counted as a failure with the fallback, never an error."""
    judge = startup.serve_on_local_engine(str(tiny_model_dir), EngineConfig())
    async with serve_judge(judge) as (url, key):
        cfg = JudgeConfig(retries=0, max_tokens=8, fallback_reward=0.5)
        reward = JudgeReward(cfg, base_url=url, api_key=key, model="judge", answer_field="answer")
        value = await score_one(reward, "It is 4.")
        await reward.aclose()
    stats = reward.take_stats()
    assert stats["reward_judge_calls"] == 1
    assert (stats["reward_judge_failures"] == 1 and value == 0.5) or 0.0 <= value <= 1.0


async def test_judge_reward_trains(tiny_model_dir, tiny_run, tmp_path):
    """`looprl train reward.type=judge`: the run starts the judge's engine, two steps."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"question": f"{k} + 1?", "answer": str(k + 1)}) + "\n"
                            for k in range(4)))  # fmt: skip
    cfg = tiny_run(
        "task.name=jsonl",
        f"task.train_path={data}",
        f"task.eval_path={data}",
        "reward.type=judge",
        "reward.judge.mode=group",
        f"reward.judge.model={tiny_model_dir}",
        "reward.judge.retries=0",
        "reward.judge.max_tokens=8",
        "sampling.max_new_tokens=8",
        "eval.size=2",
        "eval.max_new_tokens=8",
    )
    _, steps, _ = await train_and_read(cfg)
    assert [r["step"] for r in steps] == [1, 2]
    # Group mode: one call per group (2 prompts a step), and one per held-out row of the
    # first evaluation (groups of one); the tiny model's judgments are noise, so some are
    # failures, which are neither fatal nor rejected (fallback_reward=0).
    assert [r["reward_judge_calls"] for r in steps] == [2 + 2, 2]
    assert all(r["completed"] == 4 and r["rejected"] == 0 for r in steps)
    assert sum(r["reward_judge_failures"] for r in steps) >= 1


async def test_looprl_rollout_serves_a_local_judge_and_stops_it(tiny_model_dir, tmp_path):
    """`looprl rollout reward.type=judge` (no base_url): start-up resolves the judge, the
    command opens the reward with its engine, scores every rollout, and stops it."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"question": f"{k} + 1?", "answer": str(k + 1)}) + "\n"
                            for k in range(2)))  # fmt: skip
    cfg = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "task.name=jsonl",
            f"task.train_path={data}",
            "reward.type=judge",
            f"reward.judge.model={tiny_model_dir}",
            "reward.judge.retries=0",
            "reward.judge.max_tokens=8",
            "reward.judge.fallback_reward=0.25",
            f"run.fileroot={tmp_path}",
            "engine.dtype=float32",
            "rollout.group_size=2",
            "sampling.max_new_tokens=8",
        ],
    )
    out = tmp_path / "rollouts.jsonl"
    result = await collect(cfg, rows=2, split="train", out=out)
    assert result.stats()["completed"] == 4 and result.stats()["rejected"] == 0
    rewards = [json.loads(line)["reward"] for line in out.open()]
    assert len(rewards) == 4 and all(0.0 <= r <= 1.0 for r in rewards)
