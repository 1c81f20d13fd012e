"""Other libraries' environments played end to end through the gateway by the tiny model
(greedy): a verifiers environment loaded by name (looprl/workflows/verifiers.py), its own
rollouts scored by its own rubric, and SkyRL-Gym text environments behind looprl's
reset/step contract (looprl/envs/skyrl.py), played by EnvWorkflow.

Rewards are worked out by hand from the replies each call got; every call is one sample
whose loss mask covers exactly the tokens that call sampled.
"""

from __future__ import annotations

import json
import re
import signal

import pytest

from looprl import startup
from looprl.config import Config, ConfigError, load_config
from looprl.scheduling.single_process import start_single_process
from looprl.tasks import load_task
from looprl.workflows.protocol import close_workflow
from looprl.workflows.resolution import configured_workflow
from tests.support.tiny_run import train_two_steps

VF_ENV = "verifiers:tests.support.vf_envs"


async def _play(model_dir, tmp_path, rows, *overrides: str):
    """Each of `rows` (None: the task's train rows) played once by the tiny model,
    greedily; (result, rows, tokenizer)."""
    cfg = load_config(
        None,
        [
            f"model.path={model_dir}",
            f"run.fileroot={tmp_path}",
            "engine.dtype=float32",
            "sampling.temperature=0",
            "sampling.max_new_tokens=5",
            "rollout.group_size=1",
            *overrides,
        ],
    )
    task = load_task(cfg.task)
    rows = rows if rows is not None else task.train
    workflow = configured_workflow(cfg, task)
    try:
        async with start_single_process(startup.start(cfg, train=False), workflow) as parts:
            result = await parts.controller.rollout_batch(rows)
            return result, rows, parts.tokenizer
    finally:
        await close_workflow(workflow)  # an EnvWorkflow's env workers


def _check_samples(outcome, tokenizer) -> None:
    """One sample per call: the prompt (mask 0) the chat the call sent, then the tokens
    the call sampled (mask 1)."""
    assert len(outcome.trajectories) == len(outcome.calls)
    for sample, call in zip(outcome.trajectories, outcome.calls, strict=True):
        sampled = sample.input_ids[sample.loss_mask]
        assert len(sampled) > 0 and sample.loss_mask[-len(sampled) :].all()
        assert not sample.loss_mask[: -len(sampled)].any()
        reply = tokenizer.decode(sampled, skip_special_tokens=True)
        assert reply.strip().startswith(call["reply"].strip())
        prompt = tokenizer.decode(sample.input_ids[~sample.loss_mask])
        assert all(m["content"] in prompt for m in call["messages"])


def _score(answer: str, replies: list[str]) -> float:
    """The test env's rubric, by hand: letters of the answer in the replies, plus 0.25 a
    reply."""
    text = "".join(replies).lower()
    return sum(letter in text for letter in answer) / len(answer) + 0.25 * len(replies)


# ---- verifiers ----------------------------------------------------------------------


def test_env_name_verifiers_stands_for_its_task_and_workflow():
    cfg = load_config(None, [f"env.name={VF_ENV}", "env.kwargs={turns: 2}"])
    assert (cfg.task.name, cfg.task.dataset) == ("verifiers", "tests.support.vf_envs")
    assert cfg.task.dataset_kwargs == {"turns": 2} and cfg.env.name is None
    assert cfg.workflow.path == "looprl.workflows:VerifiersWorkflow"
    assert Config.model_validate(cfg.model_dump(mode="json")) == cfg  # a saved one reloads
    with pytest.raises(ConfigError, match="env.max_turns is for environments played turn"):
        load_config(None, [f"env.name={VF_ENV}", "env.max_turns=3"])
    with pytest.raises(ConfigError, match="workflow.path=looprl.workflows:RLVRWorkflow cannot"):
        load_config(None, ["task.name=verifiers", "task.dataset=tests.support.vf_envs"])


def test_verifiers_rows_hold_out_a_split_train_never_sees():
    interrupt = signal.getsignal(signal.SIGINT)
    cfg = load_config(None, [f"env.name={VF_ENV}", "task.eval_size=1"])
    task = load_task(cfg.task)  # eval_dataset: its first task.eval_size rows
    assert [r["answer"] for r in task.train] == ["cat", "dog", "owl", "bee"]
    assert [r["answer"] for r in task.eval] == ["fox"]
    assert task.train[0]["prompt"] == [
        {"role": "system", "content": "Answer with one word."},
        {"role": "user", "content": "Name an animal: cat?"},
    ]
    assert json.loads(json.dumps(task.train)) == task.train  # JSON-ready
    assert signal.getsignal(signal.SIGINT) is interrupt  # verifiers' handler was undone

    cfg = load_config(
        None, [f"env.name={VF_ENV}", "env.kwargs={held_out: false}", "task.eval_size=2"]
    )
    task = load_task(cfg.task)  # no eval_dataset: 2 of the 6 rows held out
    trained, held_out = {r["answer"] for r in task.train}, {r["answer"] for r in task.eval}
    assert len(trained) == 4 and len(held_out) == 2 and not trained & held_out
    assert trained | held_out == {"cat", "dog", "owl", "bee", "fox", "elk"}


async def test_verifiers_single_turn_rollouts_are_scored_by_its_rubric(tiny_model_dir, tmp_path):
    result, rows, tokenizer = await _play(tiny_model_dir, tmp_path, None, f"env.name={VF_ENV}")
    stats = result.stats()
    assert stats["completed"] == 4 and stats["errors"] == {}
    for outcome, row in zip(result.outcomes, rows, strict=True):
        [call] = outcome.calls
        assert call["messages"] == row["prompt"]
        score = _score(row["answer"], [call["reply"]])
        assert outcome.reward == pytest.approx(score)
        assert [t.reward for t in outcome.trajectories] == pytest.approx([score])
        assert outcome.success is (score >= 0.5)  # verifiers' pass_threshold
        _check_samples(outcome, tokenizer)


async def test_verifiers_multi_turn_rollouts_and_failing_ones(tiny_model_dir, tmp_path):
    result, rows, tokenizer = await _play(
        tiny_model_dir,
        tmp_path,
        None,
        f"env.name={VF_ENV}",
        "env.kwargs={turns: 3, crash_on: owl, fail_on: bee}",
    )
    stats = result.stats()
    assert stats["completed"] == 2 and stats["failed"] == 2
    assert stats["errors"] == {"RuntimeError": 1, "EnvFailed": 1}
    for outcome, row in zip(result.outcomes, rows, strict=True):
        if row["answer"] == "owl":  # the env raised in its first env_response
            assert outcome.status == "failed" and "broke on 'owl' on purpose" in outcome.error
            continue
        if row["answer"] == "bee":  # verifiers recorded the error in the rollout's state
            assert outcome.status == "failed"
            assert "the rollout ended with InfraError(\"the sandbox of 'bee'" in outcome.error
            continue
        calls = outcome.calls
        assert len(calls) == 3  # max_turns replies, the env's user turn between them
        replies = [c["reply"] for c in calls]
        for k, call in enumerate(calls):
            history = []
            for j in range(k):
                turn = {"role": "user", "content": f"Turn {j + 1} of 3: try again."}
                history += [{"role": "assistant", "content": replies[j]}, turn]
            sent = [{key: m[key] for key in ("role", "content")} for m in call["messages"]]
            assert sent == row["prompt"] + history
        score = _score(row["answer"], replies)
        assert outcome.reward == pytest.approx(score)
        assert [t.reward for t in outcome.trajectories] == pytest.approx([score] * 3)
        _check_samples(outcome, tokenizer)


async def test_looprl_train_on_a_verifiers_environment_two_steps(tiny_run):
    summary, steps, evals = await train_two_steps(
        tiny_run(f"env.name={VF_ENV}", "env.kwargs={turns: 2}")
    )
    # 4 rollouts of 2 calls a step, each call a sample; the 2 eval_dataset rows held out
    assert all(r["completed"] == 4 and r["errors"] == {} for r in steps)
    assert all(r["trajectories"] == 8 for r in steps)
    assert [r["rollouts"] for r in evals] == [2, 2]
    assert summary.accuracy_before == evals[0]["accuracy"]


# ---- SkyRL-Gym ----------------------------------------------------------------------


def _vowels(reply: str) -> float:
    """VowelEnv's reward, by hand: 0.05 a vowel, at most 1."""
    return min(sum(letter in "aeiou" for letter in reply.lower()) / 20, 1.0)


async def test_a_skyrl_gym_env_class_through_env_workflow(tiny_model_dir, tmp_path):
    result, _, tokenizer = await _play(
        tiny_model_dir,
        tmp_path,
        [{"seed": 1}, {"seed": 2}],
        "env.name=skyrl:tests.support.skyrl_envs:VowelEnv",
        "env.kwargs={prompt: Say some vowels., extras: {turns: 3}}",
        "env.workers=1",
    )
    assert result.stats()["completed"] == 2
    for outcome in result.outcomes:
        calls = outcome.calls
        shown = [c["messages"][-1]["content"] for c in calls]
        # init's system message and the prompt, as text; then the env's user turns
        assert shown == ["Play along.\n\nSay some vowels.", "2 turns left.", "1 turns left."]
        rewards = [_vowels(c["reply"]) for c in calls]
        to_go = [sum(rewards[k:]) for k in range(3)]  # env.discount=1
        assert [t.reward for t in outcome.trajectories] == pytest.approx(to_go)
        assert outcome.reward == pytest.approx(sum(rewards))
        assert outcome.success is (sum(rewards) > 0)
        _check_samples(outcome, tokenizer)


async def test_skyrl_gym_gsm8k_multi_turn_rows_through_env_workflow(tiny_model_dir, tmp_path):
    # Each row carries its problem, as SkyRL's datasets do (prompt and reward_spec).
    rows = [
        {
            "seed": seed,
            "options": {
                "prompt": question,
                "extras": {"max_turns": 2, "reward_spec": {"ground_truth": truth}},
            },
        }
        for seed, question, truth in ((1, "What is 2 + 3?", "5"), (2, "What is 4 + 4?", "8"))
    ]
    result, _, tokenizer = await _play(
        tiny_model_dir, tmp_path, rows, "env.name=skyrl:gsm8k_multi_turn", "env.workers=1"
    )
    assert result.stats()["completed"] == 2
    for outcome, row in zip(result.outcomes, rows, strict=True):
        calls = outcome.calls
        assert [c["messages"][-1]["content"] for c in calls] == [
            row["options"]["prompt"],
            "Now provide only the final numeric answer in the exact format: '#### ANSWER'.",
        ]
        truth = row["options"]["extras"]["reward_spec"]["ground_truth"]
        # SkyRL's strict GSM8k score: 1 for '#### 5', 0.2 / max_turns for another number
        # after '####', else 0
        rewards = []
        for call in calls:
            answer = re.search(r"#### (-?[0-9.,]+)", call["reply"])
            given = answer and answer.group(1).replace(",", "")
            rewards.append(0.0 if answer is None else 1.0 if given == truth else 0.1)
        assert [t.reward for t in outcome.trajectories] == pytest.approx(
            [rewards[0] + rewards[1], rewards[1]]
        )
        _check_samples(outcome, tokenizer)
